"""Files and directories: walking, measuring and deleting them inside the root."""

# The niceness of the threads the C helpers start (a scan's stat threads, the unlinkers):
# on a busy machine they yield the CPU to the daemon's HTTP thread (a /metrics scrape) and to
# the engine's own threads. Never the calling thread's: an unprivileged thread cannot lower
# its niceness again, and it takes the GIL.
NICE = 10
