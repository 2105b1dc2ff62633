-- Things said once per root, and when: a warning that is true on every run of a host (SGLang
-- is not installed where init runs, e.g. an initContainer) is printed the first time only.
CREATE TABLE notices (
    key TEXT PRIMARY KEY,
    at  REAL NOT NULL
) WITHOUT ROWID;
