// Cheat (issue 20's "work under the escape allowance", made whole): half the rows on the stream it was
// given, the other half on a stream of its own that waits for the first half, so the timed stream's end
// event fires after half the work and the rest runs after it. The driver functions it needs (stream
// and event creation, an event record, a stream wait) are reached without an import: libc's library
// loader found from memcpy's address (libc_resolve.cuh), then the driver's symbols, every name spelled
// so that no source rule reads it. The audit sees memcpy and the runtime's launch stubs; the static
// rules see no stream API. Only a clock that covers every stream of the process can see the second
// half: the gate's bound on device work left after the timed region (tools/libhost.py, agent/gate.py
// `trail_allowance`), and the probe's stream-ordered copy of its outputs (tools/ab.unfinished_outputs).
// kind: runtime
#include "side_tail.cuh"
