"""popart_compiler/backends/tracing.py: one re-entrant lock for torch's tracers."""
import threading

from popart_compiler.backends.tracing import TRACE_LOCK


def test_the_lock_is_re_entrant_and_excludes_other_threads():
    seen = []
    with TRACE_LOCK:
        with TRACE_LOCK:  # a pre-compile hook that compiles again
            other = threading.Thread(target=lambda: seen.append(TRACE_LOCK.acquire(
                blocking=False)))
            other.start()
            other.join()
    assert seen == [False]
    assert TRACE_LOCK.acquire(blocking=False)
    TRACE_LOCK.release()
