-- What each .trash/ entry held when a purge moved it there (the index's count, or the
-- purge's scan), less what drains have deleted of it since. GC counts an entry before it
-- drains it: read here, not walked (a walk of 9M files kept a purge's drain from starting
-- for minutes). A count only: the drain deletes what it finds in the entry.
CREATE TABLE trash_counts (
    entry TEXT PRIMARY KEY,
    files INTEGER NOT NULL,
    bytes INTEGER NOT NULL
) WITHOUT ROWID;
