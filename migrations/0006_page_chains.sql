-- Eviction over learned prefix chains (cachemgr/gc/chains.py, cachemgr/gc/value.py).
--
-- `pred`: the key of the page before this file's page in its prefix chain, as learned from the
-- order of accesses (NULL: not known yet). Kept per file row so it goes with the files.
-- `born_seq`: the access sequence of the page's first write (0: first seen by a scan); with
-- access_seq and reads it gives a chain's rate of return on the index's own clock.
ALTER TABLE pages ADD COLUMN pred TEXT;
ALTER TABLE pages ADD COLUMN born_seq INTEGER NOT NULL DEFAULT 0;
UPDATE pages SET born_seq = access_seq;
