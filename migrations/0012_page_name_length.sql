-- The longest page file name (in bytes) each namespace's dir has held, never lowered: a flat
-- dir's entry limit (ext4's two-level hash tree) depends on its names' length, and pools,
-- pp/cp ranks, two-digit TP and a long served model name make SGLang's names longer than
-- the identity alone says (a limit computed for shorter names let the dir reach ENOSPC
-- under GC's cap).
ALTER TABLE namespace_stats ADD COLUMN name_len INTEGER NOT NULL DEFAULT 0;
UPDATE namespace_stats SET name_len = coalesce((
    SELECT max(length(CAST(p.name AS BLOB))) FROM pages p
    WHERE p.namespace_id = namespace_stats.namespace_id), 0);

DROP TRIGGER pages_stats_insert;
CREATE TRIGGER pages_stats_insert AFTER INSERT ON pages BEGIN
    INSERT INTO namespace_stats (namespace_id, pages, files, bytes, digest, name_len)
    VALUES (NEW.namespace_id, 1, 1, NEW.size, cachemgr_page_digest(NEW.name, NEW.size),
            length(CAST(NEW.name AS BLOB)))
    ON CONFLICT (namespace_id) DO UPDATE SET
        pages = pages + (NOT EXISTS (
            SELECT 1 FROM pages p WHERE p.namespace_id = NEW.namespace_id
            AND p.name >= substr(NEW.name, 1, NEW.key_len)
            AND p.name < substr(NEW.name, 1, NEW.key_len) || char(1114111)
            AND p.key_len = NEW.key_len AND p.name != NEW.name)),
        files = files + 1, bytes = bytes + NEW.size,
        digest = cachemgr_xor(digest, cachemgr_page_digest(NEW.name, NEW.size)),
        name_len = max(name_len, length(CAST(NEW.name AS BLOB)));
END;
