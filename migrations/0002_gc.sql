-- GC: observation order of page accesses, and per-namespace totals kept by triggers so the
-- periodic "is there anything to do?" check reads a few rows instead of the whole page index.

-- A page's place in the order accesses were observed (reads and writes, one global counter).
-- A request reads its prefix front to back, so within one burst of accesses a larger sequence
-- means further down the prefix chain: GC evicts those (the chain's tail) first.
ALTER TABLE pages ADD COLUMN access_seq INTEGER NOT NULL DEFAULT 0;

-- Replaces pages_lru: the same prefix plus the tie-breaker GC orders by; one index, not two,
-- since every observed read updates it.
DROP INDEX pages_lru;
CREATE INDEX pages_recency ON pages(namespace_id, last_access, access_seq);

CREATE TABLE ns_usage (
    namespace_id TEXT PRIMARY KEY,
    pages        INTEGER NOT NULL DEFAULT 0,
    bytes        INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;

INSERT INTO ns_usage (namespace_id, pages, bytes)
    SELECT namespace_id, COUNT(*), SUM(size) FROM pages GROUP BY namespace_id;

CREATE TRIGGER pages_usage_insert AFTER INSERT ON pages BEGIN
    INSERT INTO ns_usage (namespace_id, pages, bytes) VALUES (NEW.namespace_id, 1, NEW.size)
    ON CONFLICT (namespace_id) DO UPDATE SET pages = pages + 1, bytes = bytes + excluded.bytes;
END;

CREATE TRIGGER pages_usage_delete AFTER DELETE ON pages BEGIN
    UPDATE ns_usage SET pages = pages - 1, bytes = bytes - OLD.size
    WHERE namespace_id = OLD.namespace_id;
END;

CREATE TRIGGER pages_usage_resize AFTER UPDATE OF size ON pages
WHEN NEW.size != OLD.size BEGIN
    UPDATE ns_usage SET bytes = bytes + NEW.size - OLD.size
    WHERE namespace_id = NEW.namespace_id;
END;
