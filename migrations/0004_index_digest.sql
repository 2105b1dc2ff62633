-- A digest of each namespace's index, so a scan can tell "the index matches the directory"
-- from one C walk (cachemgr/_dirscan.c) without comparing a million names in Python.
--
-- digest = XOR of cachemgr_page_digest(name, size) over the namespace's rows in `pages`, the
-- same function the scan applies to the files it finds. Both functions are registered on every
-- connection cachemgr opens (store.connect); a tool that writes `pages` without them fails
-- loudly ("no such function") rather than leaving the digest wrong.
ALTER TABLE namespace_stats ADD COLUMN digest INTEGER NOT NULL DEFAULT 0;

UPDATE namespace_stats SET digest = coalesce((
    SELECT cachemgr_xor_agg(cachemgr_page_digest(name, size)) FROM pages
    WHERE pages.namespace_id = namespace_stats.namespace_id), 0);

DROP TRIGGER pages_stats_insert;
CREATE TRIGGER pages_stats_insert AFTER INSERT ON pages BEGIN
    INSERT INTO namespace_stats (namespace_id, pages, bytes, digest)
    VALUES (NEW.namespace_id, 1, NEW.size, cachemgr_page_digest(NEW.name, NEW.size))
    ON CONFLICT (namespace_id) DO UPDATE SET pages = pages + 1, bytes = bytes + NEW.size,
        digest = cachemgr_xor(digest, cachemgr_page_digest(NEW.name, NEW.size));
END;

DROP TRIGGER pages_stats_delete;
CREATE TRIGGER pages_stats_delete AFTER DELETE ON pages BEGIN
    UPDATE namespace_stats SET pages = pages - 1, bytes = bytes - OLD.size,
        digest = cachemgr_xor(digest, cachemgr_page_digest(OLD.name, OLD.size))
    WHERE namespace_id = OLD.namespace_id;
END;

DROP TRIGGER pages_stats_resize;
CREATE TRIGGER pages_stats_resize AFTER UPDATE OF size ON pages BEGIN
    UPDATE namespace_stats SET bytes = bytes - OLD.size + NEW.size,
        digest = cachemgr_xor(digest, cachemgr_xor(cachemgr_page_digest(OLD.name, OLD.size),
                                                   cachemgr_page_digest(NEW.name, NEW.size)))
    WHERE namespace_id = NEW.namespace_id;
END;
