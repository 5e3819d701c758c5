"""Keeps RADICAL-Pilot's ZeroMQ endpoints on one address (phalanx's ``radical.interface``).

radical.utils binds every bridge, queue and service it starts to ``tcp://*`` (hard-coded in
``radical.utils.zmq.utils.zmq_bind`` and ``radical.utils.zmq.server.Server``), whatever
interface it advertises.  phalanx puts this directory first on the ``PYTHONPATH`` of the RP
processes it starts (client bridges and components, the pilot's agent and its components) with
``PHALANX_RADICAL_BIND=<address>``; Python imports this file at start-up, and the two functions
are replaced the moment their modules are imported, so every endpoint is bound to that address
only.  Without ``PHALANX_RADICAL_BIND`` it does nothing.  Whatever ``sitecustomize`` was next
on the path is run after it.

Self-contained on purpose (RP's processes may not import phalanx).
"""

import os
import sys


def install(addr):
    """Bind radical.utils' endpoints to ``addr``: patch the modules now if imported, else as
    soon as they are."""
    import importlib.abc

    def patch(module):
        if module.__name__ == "radical.utils.zmq.utils" and not getattr(module, "_phalanx_bind", None):

            def zmq_bind(sock):
                import zmq
                from radical.utils.url import Url

                while True:
                    port = module.find_port()
                    try:
                        sock.bind("tcp://%s:%s" % (addr, port))
                    except zmq.error.ZMQError:
                        continue  # taken meanwhile: the next free one
                    url = Url(module.as_string(sock.getsockopt(zmq.LAST_ENDPOINT)))
                    url.host = module.get_hostip()
                    return url

            module.zmq_bind = zmq_bind
            module._phalanx_bind = addr
            for name in ("pubsub", "queue", "pipe"):  # imported it by name already
                user = sys.modules.get("radical.utils.zmq." + name)
                if user is not None and hasattr(user, "zmq_bind"):
                    user.zmq_bind = zmq_bind
        elif module.__name__ == "radical.utils.zmq.server" and not getattr(module, "_phalanx_bind", None):
            iterate = module.Server._iterate_urls

            def _iterate_urls(self):
                for url in iterate(self):
                    yield url.replace("://*:", "://%s:" % addr, 1)

            module.Server._iterate_urls = _iterate_urls
            module._phalanx_bind = addr

    names = ("radical.utils.zmq.utils", "radical.utils.zmq.server")

    class Loader(importlib.abc.Loader):
        def __init__(self, inner):
            self.inner = inner

        def create_module(self, spec):
            return self.inner.create_module(spec)

        def exec_module(self, module):
            self.inner.exec_module(module)
            patch(module)

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in names:
                return None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    if spec.loader is not None:
                        spec.loader = Loader(spec.loader)
                    return spec
            return None

    for name in names:
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(type(f).__name__ == "Finder" and getattr(f, "_phalanx", False) for f in sys.meta_path):
        finder = Finder()
        finder._phalanx = True
        sys.meta_path.insert(0, finder)


def _next_sitecustomize():
    """Run the sitecustomize this one shadows, if any."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if __name__ == "sitecustomize":
    if os.environ.get("PHALANX_RADICAL_BIND"):
        install(os.environ["PHALANX_RADICAL_BIND"])
    _next_sitecustomize()
