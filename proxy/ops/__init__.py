"""Operations: the admin API, sessions as people see them, ``kvwarm inspect``, and ``--workers``."""
