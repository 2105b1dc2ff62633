-- Per-namespace aggregates of the page index, kept exact by triggers so that every writer of
-- `pages` (the daemon's index, GC, purge, the CLI) keeps them right, and /metrics reads a
-- handful of rows instead of counting a million.
CREATE TABLE namespace_stats (
    namespace_id  TEXT PRIMARY KEY,
    pages         INTEGER NOT NULL DEFAULT 0,     -- rows in `pages` (trigger-maintained)
    bytes         INTEGER NOT NULL DEFAULT 0,     -- sum of their sizes (trigger-maintained)
    page_reads    INTEGER NOT NULL DEFAULT 0,     -- lifetime reads seen, even before a manifest
    page_writes   INTEGER NOT NULL DEFAULT 0,     -- lifetime stores seen
    last_read_at  REAL,
    last_write_at REAL,
    temp_files    INTEGER NOT NULL DEFAULT 0,     -- as of the last scan
    foreign_files INTEGER NOT NULL DEFAULT 0,     -- as of the last scan
    corrupt_files INTEGER NOT NULL DEFAULT 0,     -- as of the last scan
    scanned_at    REAL
) WITHOUT ROWID;

INSERT INTO namespace_stats (namespace_id, pages, bytes)
    SELECT namespace_id, count(*), coalesce(sum(size), 0) FROM pages GROUP BY namespace_id;

CREATE TRIGGER pages_stats_insert AFTER INSERT ON pages BEGIN
    INSERT INTO namespace_stats (namespace_id, pages, bytes) VALUES (NEW.namespace_id, 1, NEW.size)
    ON CONFLICT (namespace_id) DO UPDATE SET pages = pages + 1, bytes = bytes + NEW.size;
END;

CREATE TRIGGER pages_stats_delete AFTER DELETE ON pages BEGIN
    UPDATE namespace_stats SET pages = pages - 1, bytes = bytes - OLD.size
    WHERE namespace_id = OLD.namespace_id;
END;

CREATE TRIGGER pages_stats_resize AFTER UPDATE OF size ON pages BEGIN
    UPDATE namespace_stats SET bytes = bytes - OLD.size + NEW.size
    WHERE namespace_id = NEW.namespace_id;
END;
