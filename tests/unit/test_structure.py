"""The package's shape, as docs/design.md promises it: no import circle (function-level and
TYPE_CHECKING imports count), no class over 300 lines and no function over 60, and the experience
maker and the updater reading nothing but what they were handed."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# where each top-level folder is installed (pyproject's package-dir)
PACKAGES = {"portagrpo": "portagrpo", "backends": "portagrpo.backends", "kernels": "portagrpo.kernels"}


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = f.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            out[name] = f
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every portagrpo module `name` imports, wherever the import statement is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_the_package():
    mods = modules()
    graph = {name: imports_of(name, path, set(mods)) for name, path in mods.items()}
    assert "portagrpo.train.build" in graph["portagrpo.train.trainer"]  # the graph sees the package's own imports
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_class_over_300_lines_and_no_function_over_60():
    too_long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            limit = 300 if isinstance(node, ast.ClassDef) else 60
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    too_long.append(f"{name}.{node.name}: {lines} lines")
    assert too_long == []


def test_experience_maker_and_updater_read_no_config():
    """Every input of `ExperienceMaker.make` and `Updater.update` comes through their constructors'
    and their own signatures: outside the settings' `from_config`, neither module touches a Config."""
    for rel in ("portagrpo/train/experience.py", "portagrpo/train/update.py", "portagrpo/train/pipeline.py",
                "portagrpo/train/logprobs.py", "portagrpo/train/filters.py", "portagrpo/train/schedule.py",
                *(str(p.relative_to(ROOT)) for p in (ROOT / "portagrpo/rollout/generators").glob("*.py"))):
        tree = ast.parse((ROOT / rel).read_text())
        for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)]:
            for fn in [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name != "from_config"]:
                names = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
                attrs = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}
                assert "cfg" not in names | attrs, f"{rel}: {cls.name}.{fn.name} reads the config"


SCHEDULE = "portagrpo/train/schedule.py"
MODES = ("sync", "one_step_off")


def mode_branches(tree: ast.AST) -> list[int]:
    """Lines that branch on rollout.mode: a comparison with a mode's name, or a test that reads `<...>.rollout.mode`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            values = [node.left, *node.comparators]
            if any(isinstance(v, ast.Constant) and v.value in MODES for v in values):
                found.append(node.lineno)
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            if any(isinstance(n, ast.Attribute) and n.attr == "mode" and isinstance(n.value, ast.Attribute)
                   and n.value.attr == "rollout" for n in ast.walk(node.test)):
                found.append(node.lineno)
    return sorted(set(found))


def test_no_module_outside_the_schedule_branches_on_rollout_mode():
    """`rollout.mode` names when sampling runs (train/schedule.py), and nothing else asks: other modules ask the
    schedule what it declares (`apart`, `stale`). The config's own validation (config/) says each mode's limits."""
    found = []
    for path in modules().values():
        rel = str(path.relative_to(ROOT))
        if rel == SCHEDULE or rel.startswith("portagrpo/config/"):
            continue
        text = path.read_text()
        found += [f"{rel}:{line}" for line in mode_branches(ast.parse(text))]
        if '!= "sync"' in text or "!= 'sync'" in text:
            found.append(f"{rel}: != \"sync\"")
    assert found == []
    assert mode_branches(ast.parse((ROOT / SCHEDULE).read_text())) == []  # the schedule is a registry, not an if
    code = "if cfg.rollout.mode:\n    pass\nx = 1 if r.mode == 'sync' else 2\nif hooks.mode == 'R3':\n    pass\n"
    assert mode_branches(ast.parse(code)) == [1, 3]


# Modules of the rollout pipeline and the loop, where state travels in arguments and return values. build.py is not
# among them: it configures the models it makes (`policy.config.use_cache`).
RUN_TIME = ("portagrpo/batch.py", "portagrpo/rollout/process.py", "portagrpo/rollout/generators",
            *(f"portagrpo/train/{m}.py" for m in ("trainer", "loop", "pipeline", "schedule", "filters", "logprobs",
                                                  "experience", "update", "report", "record", "checkpointer")))


def rebindings(tree: ast.AST) -> list[str]:
    """Assignments to an attribute of an object other than `self` (or `cls`)."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for sub in ast.walk(target):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                        and not (isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls"))):
                    found.append(f"line {node.lineno}: {ast.unparse(sub)}")
    return found


def test_no_attribute_is_rebound_on_another_object_at_run_time():
    """An object's state changes through its own methods: no module of the pipeline or the loop sets an attribute
    of another object (as the multi-turn source once rebound `sampling.rollout`, and the trainer wired
    `Checkpointer.source` after construction)."""
    found = []
    for rel in RUN_TIME:
        paths = sorted((ROOT / rel).glob("*.py")) if (ROOT / rel).is_dir() else [ROOT / rel]
        found += [f"{p.relative_to(ROOT)} {where}" for p in paths for where in rebindings(ast.parse(p.read_text()))]
    assert found == []
    assert rebindings(ast.parse("self.a = 1\nother.b = 2\nx.c.d += 1\n")) == ["line 2: other.b", "line 3: x.c.d"]


def dict_writes(tree: ast.AST) -> list[str]:
    """Writes into an object's `__dict__` (`obj.__dict__[key] = ...`, `obj.__dict__.update(...)`,
    `.setdefault(...)`): state hidden on another object, out of sight of `rebindings`."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in targets:
            if isinstance(target, ast.Subscript) and ast.unparse(target.value).endswith("__dict__"):
                found.append(f"line {node.lineno}: {ast.unparse(target)}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("update", "setdefault") and ast.unparse(node.func.value).endswith("__dict__")):
            found.append(f"line {node.lineno}: {ast.unparse(node.func)}")
    return found


def test_no_module_keeps_state_in_another_objects_dict():
    """Issue 52: a MoE policy's replay mode, tally and vendor top-k once lived in the Hugging Face model's `__dict__`,
    read back by every forward. Routing is data now (model/router_replay.py); nothing in the package writes into an
    object's `__dict__`."""
    found = [f"{p.relative_to(ROOT)} {where}" for p in modules().values()
             for where in dict_writes(ast.parse(p.read_text()))]
    assert found == []
    assert dict_writes(ast.parse("m.__dict__['k'] = 1\nm.__dict__.setdefault('k', 2)\nd['k'] = 3\n")) == [
        "line 1: m.__dict__['k']", "line 2: m.__dict__.setdefault"]


def protocol_members() -> set[str]:
    """Every name a Protocol of the package declares (methods and annotated fields)."""
    members = set()
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).startswith("Protocol") for b in node.bases):
                members |= {i.name for i in node.body if isinstance(i, ast.FunctionDef)}
                members |= {i.target.id for i in node.body if isinstance(i, ast.AnnAssign)}
    return members


def test_no_getattr_probe_of_a_protocol_member():
    """What a Protocol declares is asked for, never probed: no `getattr(x, "pad_id", ...)` / `hasattr(x, "eos_ids")`
    of a name any Protocol declares (RolloutEngine's pad_id, eos_ids, takes_images, ...)."""
    members = protocol_members()
    assert {"pad_id", "eos_ids", "takes_images", "generate", "prompts", "apart"} <= members
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            probe = (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                     and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2)
            if probe and isinstance(node.args[1], ast.Constant) and node.args[1].value in members:
                found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert found == []


def test_a_generator_is_one_module_that_registers_itself():
    """The promise of rollout/generators/: every module there registers exactly one generator, the registry holds
    exactly those (make_generator finds each by its name, no list names them), and no module of the package outside
    that folder imports one; the group filters and the schedules are registries too."""
    from portagrpo.rollout.generators import GENERATORS, discover
    from portagrpo.train.filters import FILTERS
    from portagrpo.train.schedule import SCHEDULES

    discover()
    folder = "portagrpo.rollout.generators"
    found = modules()
    generator_modules = {name for name in found if name.startswith(folder + ".")}
    registered = {}
    for name in sorted(generator_modules):
        calls = [node for node in ast.walk(ast.parse(found[name].read_text()))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "register"
                 and isinstance(node.func.value, ast.Name) and node.func.value.id == "GENERATORS"]
        assert len(calls) == 1, f"{name} registers {len(calls)} generators"
        registered[name] = calls[0].args[0].value
    assert sorted(GENERATORS.names()) == sorted(registered.values())
    assert len(set(registered.values())) == len(registered) >= 5
    leaks = [f"{name} imports {m}" for name, path in found.items() if not name.startswith(folder)
             for m in imports_of(name, path, set(found)) if m in generator_modules]
    assert leaks == [], leaks
    assert {"acc", "all", "score"} <= set(FILTERS.names()) and sorted(SCHEDULES.names()) == list(sorted(MODES))


HOST_READS = {"item", "tolist", "cpu", "numpy"}


def host_reads(tree: ast.AST) -> list[str]:
    """Where the code reads a value to the host: float()/int()/bool() of anything but a literal, or a tensor's
    .item()/.tolist()/.cpu()/.numpy()."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        if isinstance(fn, ast.Name) and fn.id in ("float", "int", "bool") and node.args:
            try:
                ast.literal_eval(node.args[0])
            except (ValueError, TypeError, SyntaxError):
                found.append(f"line {node.lineno}: {fn.id}({ast.unparse(node.args[0])})")
        elif isinstance(fn, ast.Attribute) and fn.attr in HOST_READS:
            found.append(f"line {node.lineno}: .{fn.attr}()")
    return found


def test_algo_makes_no_host_reads():
    """STYLE rule 1: the math returns detached tensors and the loop decides when to sync, so no module in algo/
    reads a value to the host (`float("inf")` and other literals are constants, not reads)."""
    found = [f"{path.relative_to(ROOT)} {where}" for path in sorted((ROOT / "portagrpo/algo").glob("*.py"))
             for where in host_reads(ast.parse(path.read_text()))]
    assert found == []


def test_a_steps_metrics_read_the_device_once():
    """Issue 52: step_metrics made 11 separate host reads of the step's batch statistics; they are computed on the
    device and read together (`_device_statistics`: one `.cpu()`; the list and the raw rewards' std are of that host
    copy)."""
    tree = ast.parse((ROOT / "portagrpo/train/report.py").read_text())
    reads = {f.name: host_reads(f) for f in tree.body if isinstance(f, ast.FunctionDef)
             and f.name in ("step_metrics", "_device_statistics")}
    assert reads["step_metrics"] == []
    assert sorted(r.split(": ", 1)[1] for r in reads["_device_statistics"]) == [
        ".cpu()", ".tolist()", "float(host[len(parts):].std())"]


def test_the_host_read_finder_finds_reads_and_spares_literals():
    code = "a = float('inf')\nb = int(-1)\nc = float(x.sum())\nd = y.item()\ne = bool(z)\nf = w.cpu().numpy()\n"
    assert host_reads(ast.parse(code)) == ["line 3: float(x.sum())", "line 4: .item()", "line 5: bool(z)",
                                           "line 6: .numpy()", "line 6: .cpu()"]


def test_the_device_layer_sits_below_the_model():
    """backends/ answers device questions for model/ and train/: it imports neither (the FSDP2 version shim
    lives in backends/fsdp_compat.py)."""
    mods = modules()
    for name, path in mods.items():
        if name.startswith("portagrpo.backends"):
            above = {m for m in imports_of(name, path, set(mods))
                     if m.startswith(("portagrpo.model", "portagrpo.train", "portagrpo.rollout"))}
            assert not above, f"{name} imports {sorted(above)}"


# What each lower floor must not import (wherever the import statement is). config/ reads and checks the settings
# every room is built from; the run's machinery sits above it. tools/ holds the commands, the top floor.
BELOW = {"portagrpo.config": ("portagrpo.agent", "portagrpo.model", "portagrpo.rollout", "portagrpo.train",
                              "portagrpo.tools", "portagrpo.plan", "portagrpo.cli"),
         "portagrpo.agent": ("portagrpo.tools", "portagrpo.cli", "portagrpo.train")}


def test_no_import_runs_back_up_the_floors():
    """Issue 52: config/rules.py imported agent/tools.py to check a tool file (the tool file's reading is
    config/tool_file.py now), and the warm start in agent/ imported tools/export.py (it is a command, in tools/)."""
    mods = modules()
    found = []
    for name, path in mods.items():
        for floor, above in BELOW.items():
            if name == floor or name.startswith(floor + "."):
                found += [f"{name} imports {m}" for m in sorted(imports_of(name, path, set(mods)))
                          if m.startswith(above)]
    assert found == []


PLUG_POINTS = {"portagrpo/train/build.py": ("Models", "Parts", "Runtime", "Optimization"),
               "portagrpo/rollout/engines.py": ("EngineInputs", "RolloutEngine"),
               "portagrpo/rollout/process.py": ("AheadSampler",),
               "portagrpo/rollout/generators/__init__.py": ("GeneratorInputs", "Generator", "RoundPrompts"),
               "portagrpo/train/schedule.py": ("ScheduleInputs", "Schedule"),
               "portagrpo/model/parallel.py": ("ParallelStrategy",)}


def test_no_plug_point_is_typed_any():
    """The parts a run is built from, and the Protocols they meet, name their types (a tokenizer is
    transformers' own, any of its classes); the loop asks nothing of an object that its type does not declare."""
    for rel, names in PLUG_POINTS.items():
        tree = ast.parse((ROOT / rel).read_text())
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        for name in names:
            for field in [n for n in classes[name].body if isinstance(n, ast.AnnAssign)]:
                if field.target.id not in ("tokenizer", "processor"):  # transformers' own types
                    assert "Any" != ast.unparse(field.annotation), f"{rel}: {name}.{field.target.id} is typed Any"
    for rel in ("portagrpo/train/loop.py", "portagrpo/train/trainer.py", "portagrpo/train/pipeline.py",
                "portagrpo/train/schedule.py"):
        assert "getattr(" not in (ROOT / rel).read_text(), rel


def test_rewards_do_not_import_data():
    """One arrow between rewards/ and data/: data (its converters) may use the reward's answer parsing; the rewards,
    the built-in tasks' graders included (rewards/tasks.py), never import data/."""
    mods = modules()
    for name, path in mods.items():
        if name.startswith("portagrpo.rewards"):
            data = {m for m in imports_of(name, path, set(mods)) if m.startswith("portagrpo.data")}
            assert not data, f"{name} imports {sorted(data)}"


def test_engines_read_no_config():
    """An engine is built from `EngineSettings.from_config` (rollout/settings.py), as the phases are from theirs:
    no other rollout module imports the config or reaches a `cfg`. A generator reads its own settings next to its
    class (rollout/generators/): there `cfg` appears only in the functions that read settings."""
    mods = modules()
    readers = {"from_config", "settings", "generator_name", "generator_spec", "generator_problem"}
    for name, path in mods.items():
        if not name.startswith("portagrpo.rollout") or name == "portagrpo.rollout.settings":
            continue
        tree = ast.parse(path.read_text())
        if name.startswith("portagrpo.rollout.generators"):
            inside = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in readers
                      for n in ast.walk(f)}
            reads = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "cfg"
                     or isinstance(n, ast.Attribute) and n.attr == "cfg"]
            outside = [n.lineno for n in reads if id(n) not in inside]
            assert outside == [], f"{name} reads a config outside its settings, lines {outside}"
            continue
        config = {m for m in imports_of(name, path, set(mods)) if m.startswith("portagrpo.config")}
        assert not config, f"{name} imports {sorted(config)}"
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert "cfg" not in names | attrs, f"{name} reads a config"


