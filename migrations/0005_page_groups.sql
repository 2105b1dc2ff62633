-- One logical page can be several files: SGLang writes an extra memory pool's part of a page as
-- `<key>.<pool><suffix>.bin` beside `<key><suffix>.bin`, and every TP/PP/CP rank its own file,
-- and a page is usable only while all of them are on disk (cachemgr/sglang/hicache.py). Rows stay
-- one per file (the watcher sees files, the digest covers files); a file's page is the first
-- `key_len` characters of its name, as the file format says (cachemgr/backends.py), so every
-- file of one page sorts next to the others in the primary key and a range probe finds them.
--
-- namespace_stats.pages now counts pages (distinct keys) and the new `files` counts rows.
ALTER TABLE pages ADD COLUMN key_len INTEGER NOT NULL DEFAULT 0;

-- Rows so far are SGLang pages (PAGE_RE): the key is the hex run before the first '.' or '_'.
UPDATE pages SET key_len = min(
    CASE instr(name, '.') WHEN 0 THEN length(name) + 1 ELSE instr(name, '.') END,
    CASE instr(name, '_') WHEN 0 THEN length(name) + 1 ELSE instr(name, '_') END) - 1;

-- A writer that leaves key_len out would make every file a page of its own, silently.
CREATE TRIGGER pages_key_len BEFORE INSERT ON pages
WHEN NEW.key_len < 1 OR NEW.key_len > length(NEW.name) BEGIN
    SELECT RAISE(ABORT, 'pages.key_len must be the length of the page key in name');
END;

ALTER TABLE namespace_stats ADD COLUMN files INTEGER NOT NULL DEFAULT 0;
UPDATE namespace_stats SET files = pages, pages = (
    SELECT count(DISTINCT substr(name, 1, key_len)) FROM pages
    WHERE pages.namespace_id = namespace_stats.namespace_id);

-- `pages` moves only when the first file of a page comes or its last one goes. The probe is a
-- range of the primary key: names starting with the key (char(1114111) sorts after any
-- character a name can hold) with the same key length (a longer key may start the same way).
DROP TRIGGER pages_stats_insert;
CREATE TRIGGER pages_stats_insert AFTER INSERT ON pages BEGIN
    INSERT INTO namespace_stats (namespace_id, pages, files, bytes, digest)
    VALUES (NEW.namespace_id, 1, 1, NEW.size, cachemgr_page_digest(NEW.name, NEW.size))
    ON CONFLICT (namespace_id) DO UPDATE SET
        pages = pages + (NOT EXISTS (
            SELECT 1 FROM pages p WHERE p.namespace_id = NEW.namespace_id
            AND p.name >= substr(NEW.name, 1, NEW.key_len)
            AND p.name < substr(NEW.name, 1, NEW.key_len) || char(1114111)
            AND p.key_len = NEW.key_len AND p.name != NEW.name)),
        files = files + 1, bytes = bytes + NEW.size,
        digest = cachemgr_xor(digest, cachemgr_page_digest(NEW.name, NEW.size));
END;

DROP TRIGGER pages_stats_delete;
CREATE TRIGGER pages_stats_delete AFTER DELETE ON pages BEGIN
    UPDATE namespace_stats SET
        pages = pages - (NOT EXISTS (
            SELECT 1 FROM pages p WHERE p.namespace_id = OLD.namespace_id
            AND p.name >= substr(OLD.name, 1, OLD.key_len)
            AND p.name < substr(OLD.name, 1, OLD.key_len) || char(1114111)
            AND p.key_len = OLD.key_len)),
        files = files - 1, bytes = bytes - OLD.size,
        digest = cachemgr_xor(digest, cachemgr_page_digest(OLD.name, OLD.size))
    WHERE namespace_id = OLD.namespace_id;
END;
