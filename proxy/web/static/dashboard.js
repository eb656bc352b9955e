// kvwarm's /kvwarm/ page: polls the overview API and re-binds the page's slots.
//
// The server renders the whole page; this script only keeps it fresh. All formatting is
// done by the server (proxy/web/view.py): the JSON's "view" holds the strings, and they are
// written with textContent and setAttribute only, never parsed as HTML. Slots:
//   data-k="key"           text from view.text[key]
//   data-tone-k="key"      data-tone attribute from view.text[key]
//   data-d="key"           SVG path data from view.attrs[key]
//   data-list="name"       rows of view.lists[name], cloned from <template data-for="name">;
//                          inside a row: data-f (text), data-href (a /kvwarm/ link),
//                          data-tone-f (data-tone), data-hide-empty (hidden when empty)
//   data-empty="name"      hidden while the list has rows
"use strict";

(() => {
  const body = document.body;
  const api = body.dataset.api;
  const interval = Number(body.dataset.interval) || 5000;
  const scope = body.dataset.scope;
  const status = document.getElementById("status");
  let timer = 0;
  let failures = 0;
  let running = null;

  function setText(el, value) {
    const text = value == null ? "" : String(value);
    if (el.textContent !== text) el.textContent = text;
  }

  function setAttr(el, name, value) {
    const text = value == null ? "" : String(value);
    if (el.getAttribute(name) !== text) el.setAttribute(name, text);
  }

  function each(root, selector, fn) {
    if (root.matches && root.matches(selector)) fn(root);
    for (const el of root.querySelectorAll(selector)) fn(el);
  }

  function bindRow(root, item) {
    each(root, "[data-f]", (el) => setText(el, item[el.dataset.f]));
    each(root, "[data-href]", (el) => {
      const href = String(item[el.dataset.href] || "");
      if (href.startsWith("/kvwarm/")) setAttr(el, "href", href);
      else el.removeAttribute("href");
    });
    each(root, "[data-tone-f]", (el) => setAttr(el, "data-tone", item[el.dataset.toneF]));
    each(root, "[data-hide-empty]", (el) => {
      const hide = !item[el.dataset.hideEmpty];
      if (el.hidden !== hide) el.hidden = hide;
    });
  }

  function bindList(name, rows) {
    const box = document.querySelector(`[data-list="${name}"]`);
    const template = document.querySelector(`template[data-for="${name}"]`);
    if (!box || !template) return;
    if (box.children.length === rows.length) {
      // Same number of rows: update in place, so a selection (a pin line being copied) survives.
      rows.forEach((item, i) => bindRow(box.children[i], item));
    } else {
      const fragment = document.createDocumentFragment();
      for (const item of rows) {
        const row = template.content.firstElementChild.cloneNode(true);
        bindRow(row, item);
        fragment.appendChild(row);
      }
      box.replaceChildren(fragment);
    }
    for (const el of document.querySelectorAll(`[data-empty="${name}"]`)) el.hidden = rows.length > 0;
  }

  function apply(view) {
    for (const el of document.querySelectorAll("[data-k]")) {
      if (el.dataset.k in view.text) setText(el, view.text[el.dataset.k]);
    }
    for (const el of document.querySelectorAll("[data-tone-k]")) setAttr(el, "data-tone", view.text[el.dataset.toneK]);
    for (const el of document.querySelectorAll("[data-d]")) {
      const d = view.attrs[el.dataset.d];
      if (typeof d === "string") setAttr(el, "d", d);
    }
    for (const [name, rows] of Object.entries(view.lists)) bindList(name, rows);
  }

  function setStatus(message) {
    if (!status) return;
    setText(status, message);
    status.hidden = message === "";
  }

  function schedule() {
    clearTimeout(timer);
    if (document.hidden) return; // resumed by visibilitychange
    const delay = interval * Math.min(2 ** failures, 12);
    timer = setTimeout(refresh, delay);
  }

  async function poll() {
    const controller = new AbortController();
    const deadline = setTimeout(() => controller.abort(), Math.max(2000, interval - 500));
    try {
      const response = await fetch(api, {
        cache: "no-store",
        credentials: "same-origin",
        headers: { accept: "application/json" },
        signal: controller.signal,
      });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const data = await response.json();
      if (data.scope !== scope) {
        location.reload(); // who we are changed (another key, the admin token): render anew
        return;
      }
      apply(data.view);
      failures = 0;
      setStatus("");
    } catch (error) {
      failures += 1;
      const why = error && error.name === "AbortError" ? "timed out" : String((error && error.message) || error);
      setStatus(`offline (${why}), retrying`);
    } finally {
      clearTimeout(deadline);
    }
  }

  function refresh() {
    if (!running) {
      running = poll().finally(() => {
        running = null;
        schedule();
      });
    }
    return running;
  }

  document.addEventListener("visibilitychange", () => {
    if (document.hidden) clearTimeout(timer);
    else refresh();
  });

  // For people in the console and for tests: refresh now, returns a promise.
  window.kvwarm = Object.freeze({ refresh });
  setStatus("");
  schedule();
})();
