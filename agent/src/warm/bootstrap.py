# rlaunch's warm worker (agent/src/warm.rs starts it; the agent writes this file out).
#
# Started by a node's agent before it is needed, with the interpreter and flags of the program
# (`python3 -u`), it imports what the program imports from outside its own directory (torch,
# numpy, ...), then waits. When a round needs a worker, the agent moves it into the rank's
# cgroup and writes the worker's whole command line, environment and working directory to the
# pipe named by argv[1], then closes the pipe. From here the process becomes that worker: its
# environment is replaced (os.environb, so C code sees it too), sys.argv, sys.orig_argv and
# sys.path[0] are what `python3 -u train.py ...` or `python3 -u -m pkg.train ...` would have set,
# and the program runs as a fresh `__main__`. A pipe closed with nothing written: the agent let
# it go, and it exits 0 at once.
#
# argv: bootstrap.py FD KIND TARGET (KIND: script or module).

import os
import sys


def _read_all(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _module_file(name, first, as_main=False):
    """The file of module `name` (a package's `__init__.py`, or with `as_main` its
    `__main__.py`, as `-m` runs it), found without running any of its packages' code
    (importlib.util.find_spec would import the parents)."""
    from importlib.machinery import PathFinder

    path = [first] + sys.path[1:]
    spec = None
    try:
        for part in name.split("."):
            spec = PathFinder.find_spec(part, path)
            if spec is None:
                return None
            path = list(spec.submodule_search_locations or [])
        if as_main and spec.submodule_search_locations:
            main = PathFinder.find_spec("__main__", list(spec.submodule_search_locations))
            return main.origin if main else None
    except (ImportError, ValueError):
        return None
    return spec.origin


def _imports_of(path):
    """Every absolute module name `path` imports, anywhere in it (a function's imports too)."""
    import ast

    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return []
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pkg import mod` may name a submodule: both are tried.
            names.append(node.module)
            names.extend(f"{node.module}.{a.name}" for a in node.names if a.name != "*")
    return [n for n in dict.fromkeys(names) if n.split(".")[0] != "__future__"]


# How many of the program's own files are read for their imports, at most.
_OWN_FILES = 200


def _warm_up(own_dir, program_file):
    """Imports the modules the program imports from outside `own_dir`, directly or through its
    own modules there (read, never run: the program's own code runs only as the worker). Any
    failure is the program's to meet, later, as it would cold."""
    from importlib.machinery import PathFinder
    import importlib

    own = os.path.realpath(own_dir) + os.sep
    where = {}

    def origin(top):
        if top not in where:
            try:
                spec = PathFinder.find_spec(top, sys.path)
            except (ImportError, ValueError):
                spec = None
            # Built-in and frozen modules are found by other finders, and cost nothing.
            where[top] = spec and (spec.origin or next(iter(spec.submodule_search_locations or []), ""))
        return where[top]

    def is_own(top):
        o = origin(top)
        return bool(o) and os.path.realpath(o).startswith(own)

    outside, files, seen = [], [program_file], set()
    while files and len(seen) < _OWN_FILES:
        path = files.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports_of(path):
            if not is_own(name.split(".")[0]):
                outside.append(name)
                continue
            own_file = _module_file(name, own_dir)
            if own_file and own_file.endswith(".py"):
                files.append(own_file)
    for name in dict.fromkeys(outside):
        if not origin(name.split(".")[0]):
            continue
        try:
            importlib.import_module(name)
        except KeyboardInterrupt:
            raise
        except BaseException:
            pass


def _become(message, kind, target):
    import json

    order = json.loads(message)
    argv = [bytes.fromhex(a) for a in order["argv"]]
    at = order["target_index"]
    env = {bytes.fromhex(k): bytes.fromhex(v) for k, v in order["env"]}
    # What the interpreter set itself as it started (C locale coercion: LC_CTYPE), it would
    # set again in a cold start from the same environment.
    coerced = os.environb.get(b"LC_CTYPE")
    if coerced is not None and b"LC_CTYPE" not in env and b"LC_ALL" not in env and _COERCED:
        env[b"LC_CTYPE"] = coerced
    os.environb.clear()
    os.environb.update(env)
    os.chdir(bytes.fromhex(order["cwd"]))
    if hasattr(sys, "orig_argv"):
        sys.orig_argv = [os.fsdecode(a) for a in argv]
    rest = [os.fsdecode(a) for a in argv[at + 1:]]
    if kind == "module" and _module_file(target, os.getcwd(), as_main=True) is None or (
        kind == "script" and not os.path.isfile(argv[at])
    ):
        # What only the interpreter's own start does (a missing file and its exit code 2, a
        # directory or zip with __main__, a module -m cannot find): the cold start itself, in
        # this process, with the worker's environment already set.
        sys.stdout.flush()
        sys.stderr.flush()
        os.execvp(argv[0], argv)
    import builtins
    import types

    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    if sys.version_info < (3, 14):
        # Before 3.14's lazy annotations, a script's __main__ starts with an empty dict of them.
        main.__annotations__ = {}
    sys.modules["__main__"] = main
    if kind == "module":
        import runpy

        sys.argv = ["-m"] + rest
        sys.path[0] = os.getcwd()
        # As `python -m` itself: the module runs in __main__'s namespace (the fresh one above,
        # not this file's), sys.argv[0] its file.
        runpy._run_module_as_main(target, alter_argv=True)
        return
    import importlib.machinery

    script = os.fsdecode(argv[at])
    sys.argv = [script] + rest
    path = os.path.abspath(script)
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    main.__file__ = path
    main.__cached__ = None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    try:
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        # Shown as a cold start shows it: from the program's first frame, not from this file.
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        if isinstance(e, KeyboardInterrupt):
            import signal

            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.exit(1)


def _main():
    global _COERCED
    # The agent passes RLAUNCH_WARM_LC_CTYPE=unset when it did not set LC_CTYPE: then one found
    # here was set by the interpreter itself.
    _COERCED = os.environ.pop("RLAUNCH_WARM_LC_CTYPE", None) == "unset" and "LC_CTYPE" in os.environ
    fd, kind, target = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if kind == "module":
        own_dir = os.getcwd()
        program_file = _module_file(target, own_dir, as_main=True)
    else:
        own_dir = os.path.dirname(os.path.realpath(target))
        program_file = target
    # Imports resolve as they will for the program: its own directory first.
    sys.path[0] = own_dir
    if program_file:
        _warm_up(own_dir, program_file)
    message = _read_all(fd)
    if not message:
        os._exit(0)
    _become(message, kind, target)


_main()
