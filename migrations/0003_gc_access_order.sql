-- GC: the order page accesses were observed in (per-namespace totals live in namespace_stats).

-- A page's place in the order accesses were observed (reads and writes, one global counter).
-- A request reads its prefix front to back, so within one burst of accesses a larger sequence
-- means further down the prefix chain: GC evicts those (the chain's tail) first.
ALTER TABLE pages ADD COLUMN access_seq INTEGER NOT NULL DEFAULT 0;

-- Replaces pages_lru: the same prefix plus the tie-breaker GC orders by; one index, not two,
-- since every observed read updates it.
DROP INDEX pages_lru;
CREATE INDEX pages_recency ON pages(namespace_id, last_access, access_seq);
