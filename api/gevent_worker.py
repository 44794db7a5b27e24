"""gunicorn's gevent worker, whose quick stop (SIGINT, SIGQUIT) prints no traceback.

gunicorn's gevent worker runs its SIGINT/SIGQUIT handler in a greenlet of its own (a signal handler
must not block the event loop), and that handler ends in sys.exit(0). Raised in that greenlet rather
than the main one, the SystemExit is an error to gevent, which prints it ("Traceback ... SystemExit:
0", "... failed with SystemExit"), most often while the worker is already on its way out: its main
greenlet saw `alive` go false and left (benoitc/gunicorn#3239). Here the handler's greenlet only
marks the stop; the main greenlet exits, at its next notify() (once a second, while requests are
open), as gunicorn's own "parent changed" exit does. A worker with nothing open has left already.
"""
from __future__ import annotations

import sys

import gevent
from gunicorn.workers import ggevent


class GeventWorker(ggevent.GeventWorker):
    quitting = False  # a quick stop was asked for: the main greenlet exits at its next notify()

    def handle_quit(self, sig, frame):
        gevent.spawn(self._quit)

    def _quit(self) -> None:
        self.alive = False
        self.cfg.worker_int(self)  # gunicorn's hook, as its own handler calls it
        self.quitting = True

    def notify(self):
        super().notify()
        if self.quitting:  # in the main greenlet: an exit, not an error
            sys.exit(0)
