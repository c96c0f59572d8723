"""The logic of each public object, shared by its two faces: one module per object
(:mod:`.idempotency`, :mod:`.lock`, :mod:`.fence`, :mod:`.coordinator`), each public class
of :mod:`idemlock.aio` (and the generated :mod:`idemlock._sync`) a few lines of calls over
its base here. A port holds its :mod:`.events` (and an idempotency port its
:mod:`.records`) as fields."""
