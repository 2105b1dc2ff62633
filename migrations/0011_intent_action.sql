-- GC's drop of an unbound namespace renames its dir into .trash/ as a purge does, and has the
-- same kill window before its commit: it records its intent too, whose audit row is an
-- `evict` (with GC's reason), not a `purge`. Rows of purges keep their meaning.
ALTER TABLE purge_intents ADD COLUMN action TEXT NOT NULL DEFAULT 'purge';
