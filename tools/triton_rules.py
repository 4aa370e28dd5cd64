"""The static rules on a Triton task's editable Python (its AST), checked before anything runs it.

A Triton task's source is executed in exactly one place: the sandboxed compile of the build (tools/
triton_build.py), which imports it to hand its `@triton.jit` functions to `triton.compile`. These rules
keep that import inert and the kernels pure device code, so the compile is like a C++ compile:

- the module holds only a docstring, imports of `triton` / `triton.language` (and its `extra`
  libdevice), constants (`NAME = literal` or `NAME = tl.constexpr(literal)`) and top-level functions
  decorated `@triton.jit` (nothing else: no other decorator, class, statement or import);
- inside a kernel: no name but its parameters, its locals, the module's names and the builtins Triton
  compiles (`range`, `min`, `max`, `len`, `int`, `float`, `bool`); no attribute starting with `_`
  (dunders included), `getattr`/`exec`/`eval`/`open`/`print`..., lambdas, comprehensions, `with`,
  `try`, `global`, f-strings; every attribute path from a triton name must end inside
  `triton.language` (resolved against the installed Triton, so `tl.core.builtins...` or
  `triton.runtime...` are refused), and device printing (`tl.device_print`, `print`) is not output
  a kernel may produce.

Inline PTX (`tl.inline_asm_elementwise`) is allowed, as inline asm is in a CUDA task's device code: it
cannot leave the device, and what it builds is audited (tools/triton_build.audit_triton_build: no
module-scope device variables, no external calls) and checked like any other kernel.
"""

from __future__ import annotations

import ast
import types
from dataclasses import dataclass
from pathlib import Path

ALLOWED_IMPORTS = {"triton", "triton.language", "triton.language.extra", "triton.language.extra.cuda",
                   "triton.language.extra.libdevice", "triton.language.extra.cuda.libdevice"}
KERNEL_BUILTINS = {"range", "min", "max", "len", "int", "float", "bool"}
TRITON_TOP = {"jit", "cdiv", "next_power_of_2", "language"}  # what `triton.X` may name
NO_OUTPUT = {"device_print", "static_print", "device_assert"}  # device I/O: the runner's stdout is not the kernel's
FORBIDDEN_NODES = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Global, ast.Nonlocal,
                   ast.With, ast.AsyncWith, ast.Try, ast.Import, ast.ImportFrom, ast.ClassDef, ast.FunctionDef,
                   ast.AsyncFunctionDef, ast.Yield, ast.YieldFrom, ast.Await, ast.Delete, ast.JoinedStr, ast.NamedExpr,
                   ast.Raise)
if hasattr(ast, "TryStar"):
    FORBIDDEN_NODES += (ast.TryStar,)


@dataclass(frozen=True)
class Violation:
    file: str
    line: int
    code: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: `{self.code}` — {self.reason}"


def _literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float, bool, str)) or node.value is None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _literal(node.operand)
    return False


def _chain(node: ast.AST) -> list[str] | None:
    """`a.b.c` -> ["a", "b", "c"]; None when the root is not a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


class _Rules:
    def __init__(self, rel: str, text: str):
        self.rel, self.text, self.out = rel, text, []
        self.aliases: dict[str, str] = {}  # name -> module it names (triton, triton.language, ...)
        self.module_names: set[str] = set()
        self.kernels: list[str] = []

    def bad(self, node: ast.AST, reason: str) -> None:
        code = (ast.get_source_segment(self.text, node) or type(node).__name__).splitlines()[0][:80]
        self.out.append(Violation(self.rel, getattr(node, "lineno", 0), code, reason))

    # -- the module ------------------------------------------------------------------------------
    def module(self, tree: ast.Module) -> None:
        for i, node in enumerate(tree.body):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                continue  # a docstring
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name not in ALLOWED_IMPORTS:
                        self.bad(node, f"imports `{a.name}`: a Triton task imports only triton and triton.language")
                    elif a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        self.aliases[a.name.split(".")[0]] = a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                for a in node.names:
                    full = f"{mod}.{a.name}"
                    if node.level or a.name == "*" or a.name.startswith("_") or (
                            full not in ALLOWED_IMPORTS and not (mod.startswith("triton.language") and mod in ALLOWED_IMPORTS)):
                        self.bad(node, f"imports `{full}`: a Triton task imports only triton and triton.language")
                    else:
                        self.aliases[a.asname or a.name] = full
            elif isinstance(node, ast.Assign):
                self.constant(node)
            elif isinstance(node, ast.FunctionDef):
                self.kernel_def(node)
            else:
                self.bad(node, "a Triton source holds only imports, constants and @triton.jit functions")
        self.module_names |= set(self.aliases)

    def constant(self, node: ast.Assign) -> None:
        if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name) or node.targets[0].id.startswith("_"):
            self.bad(node, "a module constant is one plain name (not starting with _)")
            return
        v = node.value
        ok = _literal(v) or (isinstance(v, ast.Call) and len(v.args) == 1 and not v.keywords and _literal(v.args[0])
                             and (c := _chain(v.func)) is not None and len(c) >= 2 and c[-1] == "constexpr"
                             and self.aliases.get(c[0], "").startswith("triton"))
        if not ok:
            self.bad(node, "a module constant is a literal or tl.constexpr(literal)")
        self.module_names.add(node.targets[0].id)

    def kernel_def(self, fn: ast.FunctionDef) -> None:
        self.module_names.add(fn.name)
        if fn.name.startswith("_"):
            self.bad(fn, "a kernel's name may not start with _")
        decos = fn.decorator_list
        ok = len(decos) == 1
        if ok:
            d = decos[0]
            call = isinstance(d, ast.Call)
            c = _chain(d.func if call else d)
            ok = c is not None and len(c) == 2 and self.aliases.get(c[0]) == "triton" and c[1] == "jit"
            if ok and call:
                ok = not d.args and all(k.arg == "noinline" and _literal(k.value) for k in d.keywords)
        if not ok:
            self.bad(fn, "a function is decorated exactly `@triton.jit` (or `@triton.jit(noinline=...)`)")
        self.kernels.append(fn.name)

    # -- kernel bodies (after every module name is known) ----------------------------------------
    def body(self, fn: ast.FunctionDef) -> None:
        args = fn.args
        params = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
        if args.vararg or args.kwarg:
            self.bad(fn, "no *args/**kwargs in a kernel")
        for d in [*args.defaults, *args.kw_defaults]:
            if d is not None and not _literal(d):
                self.bad(d, "a parameter's default is a literal")
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            if a.annotation is not None:
                self.expr_names(a.annotation, params, set())
        if fn.returns is not None:
            self.bad(fn.returns, "no return annotation")
        local = set(params)
        for node in ast.walk(ast.Module(body=fn.body, type_ignores=[])):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                if node.id in self.module_names:  # `tl = tl.core` would hide the paths behind a local
                    self.bad(node, f"`{node.id}` is a module name: a kernel does not rebind it")
                local.add(node.id)
        for name in params & self.module_names:
            self.bad(fn, f"parameter `{name}` shadows a module name")
        for stmt in fn.body:
            for node in ast.walk(stmt):
                if isinstance(node, FORBIDDEN_NODES):
                    self.bad(node, f"`{type(node).__name__}` is not allowed in a kernel")
            self.expr_names(stmt, params, local)

    def expr_names(self, tree: ast.AST, params: set[str], local: set[str]) -> None:
        seen_chains: set[int] = set()
        roots: set[int] = set()  # Names that root an attribute path (ast.walk visits the path first)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                if node.attr.startswith("_"):
                    self.bad(node, "no attribute starting with _ (dunders included)")
                if id(node) in seen_chains:
                    continue
                c = _chain(node)
                inner = node.value
                while isinstance(inner, ast.Attribute):  # the whole chain is judged once, at its top
                    seen_chains.add(id(inner))
                    inner = inner.value
                roots.add(id(inner))
                if c is not None and c[0] in self.aliases and c[0] not in local:
                    why = resolve_triton_path(self.aliases[c[0]], c[1:])
                    if why:
                        self.bad(node, why)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                if node.id.startswith("_"):
                    self.bad(node, "no name starting with _")
                elif node.id not in local and node.id not in self.module_names and node.id not in KERNEL_BUILTINS \
                        and node.id not in ("True", "False", "None"):
                    self.bad(node, f"`{node.id}` is neither a parameter, a local, a module name nor a builtin "
                                   f"Triton compiles ({', '.join(sorted(KERNEL_BUILTINS))})")
                elif node.id in self.aliases and id(node) not in roots:
                    self.bad(node, f"`{node.id}` is a module: a kernel uses it only through its attributes")


def resolve_triton_path(module: str, attrs: list[str]) -> str | None:
    """Why `module.attrs...` is not a name a kernel may use (None: it is). Walks the installed Triton:
    every intermediate must be a module inside triton.language, the end an object of triton.language."""
    import importlib

    try:
        obj: object = importlib.import_module(module)
    except ImportError as exc:
        return f"`{module}` cannot be imported here: {exc}"
    path = module
    for i, a in enumerate(attrs):
        if a.startswith("_"):
            return "no attribute starting with _"
        if path == "triton" and a not in TRITON_TOP:
            return f"`triton.{a}`: a kernel uses only triton.language (and triton.cdiv, triton.next_power_of_2)"
        if a in NO_OUTPUT:
            return f"`{a}`: device output is not something a kernel under the gate produces"
        if not hasattr(obj, a):
            return None  # not an attribute: Triton's own compile will say so
        obj = getattr(obj, a)
        path = f"{path}.{a}"
        if isinstance(obj, types.ModuleType):
            if not (obj.__name__ == "triton.language" or obj.__name__.startswith("triton.language.")):
                return f"`{path}` is the module {obj.__name__}, outside triton.language"
        elif i < len(attrs) - 1:
            return None  # an attribute of a triton.language object (a dtype's, a class's): device code
    if isinstance(obj, types.ModuleType):
        return f"`{path}` is a module: a kernel uses it only through its attributes"
    if isinstance(obj, (bool, int, float, str)) or obj is None:
        return None  # a constant of triton.language (TRITON_MAX_TENSOR_NUMEL)
    owner = getattr(obj, "__module__", None) or type(obj).__module__
    if owner == "triton._C.libtriton.ir" and isinstance(obj, type):
        return None  # an enum of the IR triton.language re-exports (tl.PropagateNan)
    if not (owner.startswith("triton.language") or path in ("triton.cdiv", "triton.next_power_of_2", "triton.jit")):
        return f"`{path}` comes from {owner}, not triton.language"
    return None


def check_source(rel: str, text: str) -> tuple[list[Violation], list[str]]:
    """The rules on one source file: (violations, the names of its @triton.jit functions)."""
    try:
        tree = ast.parse(text, filename=rel)
    except SyntaxError as exc:
        return [Violation(rel, exc.lineno or 0, (exc.text or "").strip()[:80], f"syntax error: {exc.msg}")], []
    r = _Rules(rel, text)
    r.module(tree)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            r.body(node)
    return r.out, r.kernels


def kernel_params(text: str, name: str) -> tuple[list[str], list[str]] | None:
    """(non-constexpr parameters, constexpr parameters) of top-level function `name`, in order; None if absent."""
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            plain, cx = [], []
            for a in [*node.args.posonlyargs, *node.args.args]:
                c = _chain(a.annotation) if a.annotation is not None else None
                (cx if c and c[-1] == "constexpr" else plain).append(a.arg)
            return plain, cx
    return None


def check_task_sources(task, src_root: Path) -> list[Violation]:
    """Every editable .py file of `task` under `src_root`, plus: each declared kernel exists in its
    source with exactly the manifest's signature and constexprs (so the launch matches what is built)."""
    out: list[Violation] = []
    src_root = Path(src_root)
    rels = sorted({*task.editable_files(src_root), *task.manifest.sources})
    texts = {}
    for rel in rels:
        f = src_root / rel
        if not rel.endswith(".py") or not f.is_file():
            continue
        texts[rel] = f.read_text(errors="replace")
        out += check_source(rel, texts[rel])[0]
    if task.manifest.triton is None:
        return out
    for k in task.manifest.triton.kernels:
        rel = k.source or task.manifest.sources[0]
        found = kernel_params(texts[rel], k.name) if rel in texts else None
        if found is None:
            out.append(Violation(rel, 0, k.name, f"the task's kernel `{k.name}` (task.toml [triton]) is not defined here"))
            continue
        plain, cx = found
        if plain != list(k.signature):
            out.append(Violation(rel, 0, k.name, f"`{k.name}` takes {plain}; task.toml's signature is {list(k.signature)} "
                                                 "(the launch is the task's: the parameters must match it)"))
        wanted = set(k.constexprs) | (set(task.manifest.knobs) & set(cx))
        if set(cx) != wanted:
            out.append(Violation(rel, 0, k.name, f"`{k.name}`'s constexpr parameters are {cx}; the task sets {sorted(wanted)}"))
    return out
