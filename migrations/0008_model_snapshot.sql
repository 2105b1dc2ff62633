-- The daemon's chain model, saved at shutdown next to the DB (cachemgr/gc/modelfile.py), is
-- valid only while the index is exactly what it was then. `model_stamp` holds the token of
-- that snapshot file; any change to `pages` afterwards (a CLI scan, gc or purge, another
-- daemon) deletes it, so a start-up finds either the token of a snapshot of this very index
-- or nothing (then the model is loaded from the index). The daemon takes the token away when
-- it starts (a kill -9 leaves none), so while it runs the table is empty and each trigger costs
-- a look at an empty table.
CREATE TABLE model_stamp (
    token TEXT PRIMARY KEY
) WITHOUT ROWID;

CREATE TRIGGER model_stamp_insert AFTER INSERT ON pages
WHEN EXISTS (SELECT 1 FROM model_stamp) BEGIN
    DELETE FROM model_stamp;
END;

CREATE TRIGGER model_stamp_update AFTER UPDATE ON pages
WHEN EXISTS (SELECT 1 FROM model_stamp) BEGIN
    DELETE FROM model_stamp;
END;

CREATE TRIGGER model_stamp_delete AFTER DELETE ON pages
WHEN EXISTS (SELECT 1 FROM model_stamp) BEGIN
    DELETE FROM model_stamp;
END;
