"""The executor of a process forked from one that uses tpu (a DataLoader
worker, multiprocessing's "fork" start method): tpu work there raises.

XLA's runtime threads do not survive fork(), so a compilation in the child
waits forever, and on a TPU or GPU the device belongs to the parent. As
CUDA's "Cannot re-initialize CUDA in forked subprocess", the first tpu op in
the child raises instead (a DataLoader re-raises a worker's error in the
main process, with the worker's traceback).
"""

MESSAGE = ("torchtpu: tpu tensors cannot be used in a process forked from one using the tpu "
           "device (a DataLoader worker, or multiprocessing's 'fork' start method): XLA's "
           "runtime does not survive fork(). Keep a dataset's tensors on the CPU and move "
           "each batch to the device in the main process, or use the 'spawn' start method")


class ForkedExecutor:
    records = False
    fuses = False
    waits_each_op = False
    replays = False

    def __init__(self, name):
        self.name = name  # the parent's mode, as get_eager_mode() said before the fork

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(MESSAGE)

    run = run_checked = replaced = concrete = _refuse

    def sync(self, reason="sync"):
        """Nothing to wait for: the child issues no tpu work."""
