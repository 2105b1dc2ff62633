-- Namespaces: one per identity; the directory <root>/ns/<id>/ holds its pages.
CREATE TABLE namespaces (
    id             TEXT PRIMARY KEY,              -- 16 hex digits of the identity digest
    digest         TEXT NOT NULL,                 -- full xxh3-128 identity digest
    identity_json  TEXT NOT NULL,                 -- canonical identity record
    created_at     REAL NOT NULL,                 -- unix seconds
    last_active_at REAL NOT NULL,                 -- last bind, read or write seen
    state          TEXT NOT NULL DEFAULT 'active'
                   CHECK (state IN ('active', 'purging', 'purged')),
    page_reads     INTEGER NOT NULL DEFAULT 0,    -- lifetime totals observed by the watcher
    page_writes    INTEGER NOT NULL DEFAULT 0
);

-- Which server instance uses which namespace (one row per instance).
CREATE TABLE bindings (
    instance     TEXT PRIMARY KEY,
    namespace_id TEXT NOT NULL REFERENCES namespaces(id),
    bound_at     REAL NOT NULL
);
CREATE INDEX bindings_namespace ON bindings(namespace_id);

-- The page index: every page file of every namespace, with its observed recency.
CREATE TABLE pages (
    namespace_id TEXT NOT NULL,
    name         TEXT NOT NULL,                   -- file name inside ns/<id>/
    size         INTEGER NOT NULL,
    created_at   REAL NOT NULL,                   -- first seen
    last_access  REAL NOT NULL,                   -- last read or write seen (not file atime)
    reads        INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (namespace_id, name)
) WITHOUT ROWID;
CREATE INDEX pages_lru ON pages(namespace_id, last_access);

-- Per-file weight digests, valid while (dev, ino, size, mtime_ns) are unchanged.
CREATE TABLE digest_cache (
    path      TEXT NOT NULL,
    algo      TEXT NOT NULL,                      -- e.g. xxh3-128, or fast (header + size)
    dev       INTEGER NOT NULL,
    ino       INTEGER NOT NULL,
    size      INTEGER NOT NULL,
    mtime_ns  INTEGER NOT NULL,
    digest    TEXT NOT NULL,
    hashed_at REAL NOT NULL,
    PRIMARY KEY (path, algo)
);

-- Every destructive action, with its reason and who asked.
CREATE TABLE audit (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    at           REAL NOT NULL,
    action       TEXT NOT NULL,                   -- purge, evict, delete-trash, ...
    namespace_id TEXT,
    reason       TEXT NOT NULL,
    actor        TEXT NOT NULL,                   -- cli, http, auto
    pages        INTEGER NOT NULL DEFAULT 0,
    bytes        INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX audit_at ON audit(at);
