-- A purge about to rename a namespace dir into .trash/, committed before the rename: a purge
-- killed after the rename and before its transaction committed left a trash entry that GC
-- drained later, and no `purge` audit row. The purge's own transaction deletes its row as it
-- writes that audit row; a row found later is settled once (cachemgr.ns.purge_intent).
CREATE TABLE purge_intents (
    entry        TEXT PRIMARY KEY,   -- the .trash/ name the dir gets (a recreated one: + "n")
    namespace_id TEXT NOT NULL,
    reason       TEXT NOT NULL,
    actor        TEXT NOT NULL,
    pages        INTEGER NOT NULL,   -- the audit row's, as the plan counted them
    bytes        INTEGER NOT NULL,
    at           REAL NOT NULL,
    dev          INTEGER NOT NULL,   -- the dir's (st_dev, st_ino): whether it moved
    ino          INTEGER NOT NULL
) WITHOUT ROWID;
