# rlaunch's warm worker (agent/src/warm.rs starts it; the agent writes this file out).
#
# Started by a node's agent before it is needed, with the interpreter and flags of the program
# (`python3 -u`), it imports what the program's leading imports name from installed
# distributions (torch, numpy, ...), then waits. When a round needs a worker, the agent moves it
# into the rank's cgroup and writes the worker's whole command line, environment and working
# directory to the pipe named by argv[1], then closes the pipe. From here the process becomes
# that worker: its environment is replaced (os.environb, so C code sees it too), sys.argv,
# sys.orig_argv and sys.path[0] are what `python3 -u train.py ...` or `python3 -u -m pkg.train`
# would have set, and the program runs in `__main__` (the same module object, emptied, as a
# cold start's). A pipe closed with nothing written: the agent let it go, and it exits 0 at once.
#
# What is imported ahead, and with which environment, is chosen so that importing it cannot
# differ from the cold start's import:
# - only the import statements the program (or a module of its own directory that those
#   statements import) begins with, before any other statement: a program that sets a variable,
#   a warnings filter or sys.path before an import has that import run as the worker; and what
#   such a library imports lazily on first use (`_LAZY`: torch._dynamo for torch), or on a call
#   that the program's own files name (`_LAZY_CALLS`: inductor for a program that calls
#   `torch.compile(`);
# - only modules found in site-packages or dist-packages (installed distributions), never the
#   program's own or anything on PYTHONPATH;
# - with the rank's variables of the round the agent expects next (RANK, WORLD_SIZE, ...):
#   when the order's differ (the node's ranks moved, a spare joins) and a module imported ahead
#   looked one of them up, the interpreter starts again cold, in this same process (exec), so
#   nothing imported with the wrong rank is ever used.
#
# The bootstrap's own modules (ast, json, select, runpy, ...) are imported first, before the
# program's directory goes first on sys.path and without PYTHONPATH: from the interpreter's
# library, so that a file of the program's with the same name (an `ast.py` beside `train.py`)
# cannot break the bootstrap. Those of them that a cold start would import from a file (all but
# the built-in and frozen ones) are then forgotten from sys.modules, with their packages, before
# anything is imported for the program: the program, and the imports made ahead for it, import
# them again with the program's directory first, as a cold start does (its own `ast.py`
# included). What still differs: a built-in or frozen module the bootstrap imported (runpy,
# importlib.util on 3.11) stays imported, as no file can shadow it anyway; and the bootstrap
# itself goes on with the library's modules it holds.
#
# argv: bootstrap.py FD KIND TARGET (KIND: script or module).

import os
import sys

_AT_START = frozenset(sys.modules)
_path = sys.path[:]
_pythonpath = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
# Without sys.path[0] (this file's directory; with -P it is not there) and PYTHONPATH's entries:
# the interpreter's library first.
sys.path[:] = [
    p for i, p in enumerate(_path) if not (i == 0 and not getattr(sys.flags, "safe_path", False))
    and os.path.abspath(p or ".") not in _pythonpath
]
import ast  # noqa: E402
import builtins  # noqa: E402
import importlib  # noqa: E402
import importlib.machinery  # noqa: E402
import json  # noqa: E402
import runpy  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402

sys.path[:] = _path
del _path, _pythonpath
_OWN_IMPORTS = frozenset(sys.modules) - _AT_START
_PathFinder = importlib.machinery.PathFinder

# Variables the warm interpreter was started with that an order may give otherwise (the node's
# ranks moved in the new round). Read while the imports were made ahead (looked up through
# os.environ: `os.environ[k]`, `.get`, `in`, `os.getenv`; a scan of every variable, as tqdm makes
# for its own, is not a lookup), a different value makes the interpreter start again cold.
_RANK_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
)
# Read by C code as the interpreter or a library starts (the interpreter's path, OpenMP's
# threads, CUDA's devices): compared whether looked up or not.
_START_VARS = ("PYTHONPATH", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")

# The variables looked up through os.environ while the imports were made ahead.
_LOOKED_UP = set()


class _Watched(os._Environ):
    """os.environ's class while the imports are made ahead: it notes each lookup."""

    def __getitem__(self, key):
        f = sys._getframe(1)
        for _ in range(3):
            if f is None:
                break
            code = f.f_code
            if (code.co_name == "__iter__" and "_collections_abc" in code.co_filename) or (
                code.co_name == "copy" and code.co_filename.endswith("os.py")
            ):
                # A scan of every variable (items(), values(), copy()), not a lookup.
                break
            f = f.f_back
        else:
            _LOOKED_UP.add(key)
        return os._Environ.__getitem__(self, key)

# Modules a library imports lazily, the first time a program uses it as every program does:
# torch imports torch._dynamo (seconds) when the first optimizer is made.
_LAZY = {"torch": ["torch._dynamo"]}
# Modules a library imports lazily when a program calls one of its functions, imported ahead for
# a program whose own files name that call: torch.compile imports inductor (0.9 s here, with
# torch._dynamo imported already), before the model's first step compiles anything.
_LAZY_CALLS = {"torch": [("torch.compile(", ["torch._inductor.compile_fx"])]}
# Functions of those modules called ahead too, once imported: what depends on the installation
# alone and each process computes once. Inductor's cache keys hash the source files of torch and
# Triton at a process's first compile (0.13 s and 0.3 s here, half of a replacement worker's first
# step with the cache warm); neither touches a device. Not under TORCH_TRACE: their timing event
# would open the process's trace file before the process group names its rank.
_AHEAD_CALLS = {"torch._inductor.compile_fx": [("torch._inductor.codecache", "torch_key"),
                                               ("torch._inductor.codecache", "triton_key")]}
# Inductor reads its settings from the environment when imported: a program whose files name
# them (or its config module) may set them first, so for it nothing of inductor is imported
# ahead, and the import happens where a cold start makes it.
_LAZY_CALLS_UNLESS = ("TORCHINDUCTOR", "_inductor")

# How many of the program's own files are read for their imports, at most.
_OWN_FILES = 100


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
    path = [first] + sys.path[1:]
    spec = None
    try:
        for part in name.split("."):
            spec = _PathFinder.find_spec(part, path)
            if spec is None:
                return None
            path = list(spec.submodule_search_locations or [])
        if as_main and spec.submodule_search_locations:
            main = _PathFinder.find_spec("__main__", list(spec.submodule_search_locations))
            return main.origin if main else None
    except (ImportError, ValueError):
        return None
    return spec.origin


def _read(path):
    """The bytes of the file at `path` (empty when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _leading_imports(source, path):
    """The absolute module names of the import statements `source` (the file at `path`) begins
    with (after its docstring), up to its first other statement."""
    try:
        tree = ast.parse(source, filename=path)
    except (SyntaxError, ValueError):
        return []
    names = []
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pkg import mod` may name a submodule: both are tried.
            names.append(node.module)
            names.extend(f"{node.module}.{a.name}" for a in node.names if a.name != "*")
        else:
            break
    return [n for n in dict.fromkeys(names) if n.split(".")[0] != "__future__"]


def _installed(where):
    parts = os.path.realpath(where).split(os.sep)
    return "site-packages" in parts or "dist-packages" in parts


def _warm_up(own_dir, program_file, fd):
    """Imports, ahead, what the program's leading imports name from installed distributions
    (see the top of this file). Stops as soon as the order comes. Any failure is the program's
    to meet, later, as it would cold."""
    own = os.path.realpath(own_dir) + os.sep
    where = {}

    def origin(top):
        if top not in where:
            try:
                spec = _PathFinder.find_spec(top, sys.path)
            except (ImportError, ValueError):
                spec = None
            # Built-in and frozen modules are found by other finders, and cost nothing.
            where[top] = spec and (spec.origin or next(iter(spec.submodule_search_locations or []), ""))
        return where[top]

    outside, files, seen, calls, configures = [], [program_file], set(), set(), False
    wanted = {call for uses in _LAZY_CALLS.values() for call, _ in uses}
    while files and len(seen) < _OWN_FILES:
        path = files.pop(0)
        if path in seen:
            continue
        seen.add(path)
        source = _read(path)
        calls |= {c for c in wanted if c.encode() in source}
        configures = configures or any(t.encode() in source for t in _LAZY_CALLS_UNLESS)
        for name in _leading_imports(source, path):
            o = origin(name.split(".")[0])
            if not o:
                continue
            if os.path.realpath(o).startswith(own):
                own_file = _module_file(name, own_dir)
                if own_file and own_file.endswith(".py"):
                    files.append(own_file)
            elif _installed(o):
                outside.append(name)
    tops = list(dict.fromkeys(n.split(".")[0] for n in outside))
    lazy = [m for top in tops for m in _LAZY.get(top, [])]
    if not configures:
        lazy += [m for top in tops for call, mods in _LAZY_CALLS.get(top, []) if call in calls for m in mods]
    plain = os.environ.__class__
    os.environ.__class__ = _Watched
    try:
        for name in dict.fromkeys(outside + lazy):
            if select.select([fd], [], [], 0)[0]:
                # The order came: the rest is the program's to import.
                return
            try:
                importlib.import_module(name)
            except KeyboardInterrupt:
                raise
            except BaseException:
                pass
        ahead = [] if os.environ.get("TORCH_TRACE") else lazy
        for name in ahead:
            for module, function in _AHEAD_CALLS.get(name, []) if name in sys.modules else []:
                if select.select([fd], [], [], 0)[0]:
                    return
                try:
                    getattr(sys.modules[module], function)()
                except KeyboardInterrupt:
                    raise
                except BaseException:
                    pass
    finally:
        os.environ.__class__ = plain


def _forget_own_imports():
    """Forgets, from sys.modules, the bootstrap's own imports that a cold start would import
    from files, and every module of their packages (see the top of this file); the bootstrap
    keeps using the module objects it holds."""
    def from_a_file(top):
        spec = getattr(sys.modules.get(top), "__spec__", None)
        return top in _OWN_IMPORTS and getattr(spec, "has_location", False)

    from_files = {top for top in {name.partition(".")[0] for name in _OWN_IMPORTS} if from_a_file(top)}
    for name in _OWN_IMPORTS:
        if name.partition(".")[0] in from_files:
            sys.modules.pop(name, None)


def _become(message, kind, target, warm_env):
    order = json.loads(message)
    argv = [bytes.fromhex(a) for a in order["argv"]]
    at = order["target_index"]
    # The worker's environment: each variable the order names changes from the value this
    # interpreter was started with to the worker's, unless the start itself changed it (an
    # interpreter wrapper's variables, the locale Python coerced): that stays, as a cold start
    # of the same command would set it again.
    started = _STARTED_ENV
    for k, was, new in order["env"]:
        k = bytes.fromhex(k)
        was = None if was is None else bytes.fromhex(was)
        if started.get(k) != was:
            continue
        if new is None:
            os.environb.pop(k, None)
        else:
            os.environb[k] = bytes.fromhex(new)
    os.chdir(bytes.fromhex(order["cwd"]))
    moved = [
        k
        for k in _RANK_VARS + _START_VARS
        if (k in _START_VARS or k in _LOOKED_UP) and warm_env.get(k) != os.environ.get(k)
    ]
    if (
        moved
        or (kind == "module" and _module_file(target, os.getcwd(), as_main=True) is None)
        or (kind == "script" and not os.path.isfile(argv[at]))
    ):
        # Imports made with other ranks' variables, or what only the interpreter's own start
        # does (a missing file and its exit code 2, a module -m cannot find): the cold start
        # itself, in this process, with the worker's environment already set.
        sys.stdout.flush()
        sys.stderr.flush()
        os.execvp(argv[0], argv)
    if hasattr(sys, "orig_argv"):
        sys.orig_argv = [os.fsdecode(a) for a in argv]
    rest = [os.fsdecode(a) for a in argv[at + 1:]]
    safe_path = getattr(sys.flags, "safe_path", False)

    # __main__ is the module object the interpreter made (dill and others hold it), emptied of
    # this file's names and filled as a cold start fills it. From here only locals are used.
    _sys, _os, _exec, _compile, _open, _isinstance, _getattr = sys, os, exec, compile, open, isinstance, getattr
    _BaseException, _SystemExit, _KeyboardInterrupt = BaseException, SystemExit, KeyboardInterrupt
    _builtins, _signal = builtins, signal
    loader_class = importlib.machinery.SourceFileLoader
    run_module = runpy._run_module_as_main
    g = sys.modules["__main__"].__dict__
    g.clear()
    g.update(__name__="__main__", __doc__=None, __package__=None, __loader__=None, __spec__=None)
    g["__builtins__"] = _builtins
    if _sys.version_info < (3, 14):
        # Before 3.14's lazy annotations, a script's __main__ starts with an empty dict of them.
        g["__annotations__"] = {}
    if kind == "module":
        _sys.argv = ["-m"] + rest
        if not safe_path:
            _sys.path[0] = _os.getcwd()
        # As `python -m` itself: the module runs in __main__'s namespace, sys.argv[0] its file.
        run_module(target, alter_argv=True)
        return
    script = _os.fsdecode(argv[at])
    _sys.argv = [script] + rest
    # As the interpreter sets them: __file__ joined to the directory, not normalised; the
    # script's real directory first on sys.path (unless -P / PYTHONSAFEPATH).
    path = script if _os.path.isabs(script) else _os.path.join(_os.getcwd(), script)
    if not safe_path:
        _sys.path[0] = _os.path.dirname(_os.path.realpath(script))
    g["__file__"] = path
    g["__cached__"] = None
    g["__loader__"] = loader_class("__main__", path)
    with _open(path, "rb") as f:
        code = _compile(f.read(), path, "exec", dont_inherit=True)
    try:
        _exec(code, g)
    except _SystemExit:
        raise
    except _BaseException as e:
        # Shown as a cold start shows it: from the program's first frame, not from this file.
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        _sys.excepthook(type(e), e.with_traceback(tb), tb)
        if _isinstance(e, _KeyboardInterrupt):
            _sys.stdout.flush()
            _sys.stderr.flush()
            _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
            _os.kill(_os.getpid(), _signal.SIGINT)
        _sys.exit(1)


def _main():
    global _STARTED_ENV
    _STARTED_ENV = dict(os.environb)
    fd, kind, target = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    warm_env = {k: os.environ.get(k) for k in _RANK_VARS + _START_VARS}
    safe_path = getattr(sys.flags, "safe_path", False)
    if kind == "module":
        own_dir = os.getcwd()
        program_file = _module_file(target, own_dir, as_main=True)
    else:
        own_dir = os.path.dirname(os.path.realpath(target))
        program_file = target
    # Imports resolve as they will for the program: its own directory first, and none of the
    # bootstrap's own modules imported already that the program would import from a file.
    _forget_own_imports()
    if not safe_path:
        sys.path[0] = own_dir
    if program_file:
        _warm_up(own_dir, program_file, fd)
    message = _read_all(fd)
    if not message:
        os._exit(0)
    _become(message, kind, target, warm_env)


_main()
