from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightship import models
from lightship.errors import ConfigError, RunError


def spec(name: str, **over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "name": name,
        "kwargs": {},
        "in_channels": 1,
        "num_classes": 10,
        "image_size": 28,
        "mean": [10.0],
        "std": [20.0],
    }
    base.update(over)
    return base


def test_normalize_is_affine_on_raw_pixels() -> None:
    norm = models.Normalize([10.0, 20.0], [2.0, 4.0])
    x = torch.tensor([[[[10]], [[0]]]], dtype=torch.uint8)  # [1, 2, 1, 1]
    out = norm(x)
    assert out.dtype == torch.float32
    assert out.flatten().tolist() == pytest.approx([0.0, -5.0])


def test_normalize_rejects_bad_stats() -> None:
    with pytest.raises(ValueError):
        models.Normalize([0.0], [0.0])
    with pytest.raises(ValueError):
        models.Normalize([0.0, 1.0], [1.0])


@pytest.mark.parametrize(
    ("name", "channels", "size", "kwargs"),
    [
        ("digits_cnn", 1, 28, {}),
        ("digits_cnn", 1, 40, {"stages": [[4], [8, 8]]}),
        ("resnet", 3, 32, {"width": 8}),
        ("resnet", 3, 20, {"width": 8}),
        ("mlp", 1, 16, {"hidden": [32]}),
    ],
)
def test_registry_models_take_uint8_any_batch(
    name: str, channels: int, size: int, kwargs: dict[str, object]
) -> None:
    model = models.create(
        spec(
            name,
            kwargs=kwargs,
            in_channels=channels,
            image_size=size,
            mean=[0.0] * channels,
            std=[1.0] * channels,
        )
    ).eval()
    assert isinstance(model[0], models.Normalize)
    for n in (1, 3):
        x = torch.randint(0, 256, (n, channels, size, size), dtype=torch.uint8)
        assert model(x).shape == (n, 10)


def test_resnet18_has_the_documented_size() -> None:
    model = models.create(
        spec("resnet", in_channels=3, image_size=32, mean=[0.0] * 3, std=[1.0] * 3)
    )
    assert 11_000_000 < models.count_parameters(model) < 11_300_000


class TwoTimes(nn.Module):
    """A user model that takes none of the standard arguments."""

    def __init__(self, scale: float = 2.0) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1) * self.scale


def test_user_model_by_import_path_gets_only_the_arguments_it_takes() -> None:
    model = models.create(
        spec(f"{__name__}:TwoTimes", kwargs={"scale": 3.0}, mean=[1.0], std=[2.0])
    )
    x = torch.full((1, 1, 1, 1), 5, dtype=torch.uint8)
    assert model(x).item() == pytest.approx((5 - 1) / 2 * 3)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("resnet50", "unknown model 'resnet50': use one of digits_cnn, mlp, resnet"),
        (
            "no_such_pkg.mod:Net",
            r"cannot import no_such_pkg.mod \(No module named 'no_such_pkg'\): install it, or "
            "run with PYTHONPATH=<folder holding no_such_pkg/>$",
        ),
        ("lightship.models:Nope", "has no class 'Nope'"),
        # a checkpoint naming any callable must not get it called (shell commands, files)
        ("os:system", "'os:system' is not a torch.nn.Module class"),
        ("builtins:open", "'builtins:open' is not a torch.nn.Module class"),
        ("lightship.models:create", "is not a torch.nn.Module class"),
        # an empty module was imported in lightship's frames: "fix the module" blamed ours
        (":Net", r"model ':Net' needs a module and a class, as 'package.module:Class'"),
        ("mymod:", r"model 'mymod:' needs a module and a class"),
        # a file's path: the hint had been "\(mymod:py\)"
        ("mymod.py:Net", r"names a file: give its module's name, model.name=mymod:Net, and run"),
        ("models/net.py:Net", r"give its module's name, model.name=models.net:Net"),
    ],
)
def test_bad_model_names(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        models.create(spec(name))


def test_a_model_refusing_the_datas_size_says_to_change_the_data_settings() -> None:
    """data.image_size=4 passes the config's check and the digits CNN refuses it: the fix is
    data.image_size, not model.kwargs (none were given)."""
    with pytest.raises(ConfigError) as err:
        models.create(spec("digits_cnn", image_size=4))
    assert str(err.value).endswith(
        "image_size 4 is too small for 3 pooling stages; check data.image_size and "
        "data.channels (the model's image_size and in_channels), or choose another model.name"
    )


def test_a_users_model_failing_on_its_own_is_told_to_fix_it() -> None:
    """Not to check data.image_size and data.channels, which it may not even take."""
    with pytest.raises(ConfigError) as err:
        models.create(spec(f"{__name__}:Broken"))
    assert "AttributeError: " in str(err.value) and "test_models.py, line" in str(err.value)
    assert str(err.value).endswith(
        "; fix the model there, or data.image_size / data.channels if it refuses those"
    )


class Broken(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.head = nn.Linaer(8, num_classes)  # type: ignore[attr-defined]


class NeedsDepth(nn.Module):
    def __init__(self, depth: int, num_classes: int, *, width: int) -> None:
        super().__init__()
        self.head = nn.Linear(depth * width, num_classes)


def test_a_model_argument_lightship_does_not_pass_is_named_with_how_to_give_it() -> None:
    # called without it, Python's TypeError pointed at lightship's own call as the line to fix
    with pytest.raises(ConfigError) as err:
        models.create(spec(f"{__name__}:NeedsDepth"))
    assert str(err.value) == (
        f"model {__name__}:NeedsDepth requires 'depth', 'width', which lightship does not pass "
        "(it passes in_channels, num_classes, image_size to a model that takes them, and "
        "model.kwargs): give them in model.kwargs, e.g. --set model.kwargs.depth=VALUE, or a "
        "default in the model"
    )
    with pytest.raises(ConfigError, match=r"requires 'width', .* give it in model.kwargs, e"):
        models.create(spec(f"{__name__}:NeedsDepth", kwargs={"depth": 2}))
    built = models.create(spec(f"{__name__}:NeedsDepth", kwargs={"depth": 2, "width": 3}))
    assert built.net.head.in_features == 6  # type: ignore[union-attr]
    # positional-only: no model.kwargs can give it, so that is not the advice
    with pytest.raises(ConfigError, match="missing 1 required positional argument: 'depth'"):
        models.create(spec(f"{__name__}:PositionalOnly"))


class PositionalOnly(nn.Module):
    def __init__(self, depth: int, /, num_classes: int = 2) -> None:
        super().__init__()
        self.head = nn.Linear(depth, num_classes)


def test_bad_model_kwargs_say_which() -> None:
    with pytest.raises(ConfigError, match="check model.kwargs"):
        models.create(spec("digits_cnn", kwargs={"depth": 3}))
    with pytest.raises(ConfigError, match=r"dropout must be a number in \[0, 1\).*got 2; check"):
        models.create(spec("digits_cnn", kwargs={"dropout": 2}))  # a value it refuses


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        # `--set model.kwargs.stages=abc`: torch used to answer with its own error about sizes
        ("digits_cnn", {"stages": "abc"}, "stages must be a list of lists of widths"),
        ("digits_cnn", {"stages": []}, "stages must be a list of lists of widths"),
        ("digits_cnn", {"stages": [[32], [0]]}, r"each of stages must be .*got \[0\]"),
        ("digits_cnn", {"stages": [32, 64]}, r"each of stages must be .*got 32"),
        ("digits_cnn", {"stages": [[32.5]]}, "each of stages must be a list of positive whole"),
        ("resnet", {"width": "wide"}, "width must be a positive whole number, e.g. 64; got 'wide'"),
        ("resnet", {"blocks": [2, -1]}, r"blocks must be .*\[2, 2, 2, 2\]; got \[2, -1\]"),
        ("mlp", {"hidden": [True]}, r"hidden must be a list of positive whole numbers"),
        ("mlp", {"dropout": "x"}, r"dropout must be a number in \[0, 1\)"),
    ],
)
def test_built_in_models_name_the_bad_setting(
    name: str, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message + ".*check model.kwargs"):
        models.create(spec(name, kwargs=kwargs))
    # and an empty hidden list is a linear model, not an error
    assert isinstance(models.create(spec("mlp", kwargs={"hidden": []})), nn.Module)


def test_model_kwargs_it_does_not_take_are_named_with_the_ones_it_does() -> None:
    with pytest.raises(models.UnknownModelArguments) as err:
        models.create(spec(f"{__name__}:TwoTimes", kwargs={"stages": [[8]], "scale": 2.0}))
    assert str(err.value) == (
        f"model '{__name__}:TwoTimes' takes no argument 'stages' (it takes scale); "
        "check model.kwargs"
    )
    assert (err.value.unknown, err.value.accepted) == (["stages"], ["scale"])
    assert not models.takes_argument(f"{__name__}:TwoTimes", "num_classes")
    assert models.takes_argument("digits_cnn", "num_classes")


USER_MODULE = "lightship_test_user_model"


def test_a_checkpoint_whose_model_module_cannot_be_imported_says_where_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # report and `serve --variant checkpoint` load best.ckpt for the eager model: they said
    # "(... is it installed?): re-export it", and re-exporting gave the same error
    from lightship.runtime import load_predictor

    folder = tmp_path / "mm"
    folder.mkdir()
    module = folder / f"{USER_MODULE}.py"
    module.write_text("from torch import nn\n\n\nclass Net(nn.Flatten):\n    pass\n")
    monkeypatch.syspath_prepend(str(folder))
    name = f"{USER_MODULE}:Net"
    assert models.module_file(name) == str(module)
    model_spec = spec(name, module_file=str(module))
    state = {f"model.{k}": v for k, v in models.create(model_spec).state_dict().items()}
    hparams = {"model_spec": model_spec, "labels": ["a"], "input_spec": {}, "data_spec": {}}
    ckpt = tmp_path / "best.ckpt"
    torch.save({"state_dict": state, "hyper_parameters": hparams}, ckpt)

    sys.path.remove(str(folder))  # a later stage run without PYTHONPATH
    monkeypatch.delitem(sys.modules, USER_MODULE)
    monkeypatch.chdir(tmp_path)
    cannot = (
        f"checkpoint {ckpt}: model '{name}': cannot import {USER_MODULE} "
        f"(No module named '{USER_MODULE}'): install it, or run with PYTHONPATH="
    )
    with pytest.raises(RunError) as err:
        load_predictor(ckpt)
    assert str(err.value) == cannot + "mm (its folder at training)"
    assert models.pythonpath_prefix(name, str(module)) == "PYTHONPATH=mm "

    moved = folder.with_name("elsewhere")
    folder.rename(moved)
    with pytest.raises(RunError) as err:
        load_predictor(ckpt)
    assert str(err.value) == cannot + f"<folder of {USER_MODULE}.py>"

    monkeypatch.syspath_prepend(str(moved))  # the fix: the module on the import path
    assert load_predictor(ckpt).labels == ["a"]


@pytest.mark.parametrize(
    ("module", "file", "root"),
    [
        ("mymodels", "/w/mm/mymodels.py", "/w/mm"),
        ("pkg.nets", "/w/src/pkg/nets.py", "/w/src"),
        ("pkg", "/w/src/pkg/__init__.py", "/w/src"),
    ],
)
def test_the_import_root_is_the_folder_holding_the_top_package(
    module: str, file: str, root: str
) -> None:
    assert models.import_root(module, file) == Path(root)


@pytest.mark.parametrize("package", [False, True])
def test_the_pythonpath_of_a_moved_model_module_is_where_it_is_found_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, package: bool
) -> None:
    # Trained from old/, exported with PYTHONPATH=new: the next command needs new/, where
    # the old folder no longer exists.
    top = f"{USER_MODULE}_moved_{int(package)}"
    module = f"{top}.nets" if package else top
    where = tmp_path / "new" / (f"{top}/nets.py" if package else f"{top}.py")
    where.parent.mkdir(parents=True)
    if package:
        (where.parent / "__init__.py").write_text("")
    where.write_text("from torch import nn\n\n\nclass Net(nn.Flatten):\n    pass\n")
    trained = str(tmp_path / "old" / where.relative_to(tmp_path / "new"))
    monkeypatch.chdir(tmp_path)
    name = f"{module}:Net"
    assert models.pythonpath_prefix(name, trained) == "PYTHONPATH=old "  # not found: the guess

    monkeypatch.setenv("PYTHONPATH", "new")
    monkeypatch.syspath_prepend(str(tmp_path / "new"))
    assert models.pythonpath_prefix(name, trained) == "PYTHONPATH=new "
    monkeypatch.delenv("PYTHONPATH")  # found some other way (installed): a plain shell finds it
    assert models.pythonpath_prefix(name, trained) == ""


def test_a_model_name_a_letter_off_is_answered_with_the_close_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    top = f"{USER_MODULE}_near"
    (tmp_path / f"{top}.py").write_text(
        "from torch import nn\n\n\nclass EdgeNet(nn.Flatten):\n    pass\n\n\n"
        "class Block(nn.Identity):\n    pass\n\n\nHelper = int\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path.parent)
    with pytest.raises(ConfigError) as err:  # the module's name mistyped
        models.resolve(f"{top}x:EdgeNet")
    assert str(err.value).endswith(f": did you mean '{top}' (a module on the import path)?")
    with pytest.raises(ConfigError) as err:  # the class's
        models.resolve(f"{top}:EdgeNett")
    assert str(err.value) == (
        f"model '{top}:EdgeNett': {top} has no class 'EdgeNett'; did you mean 'EdgeNet'?"
    )
    with pytest.raises(ConfigError) as err:  # nothing close: its torch modules, not `Helper`
        models.resolve(f"{top}:Resnet")
    assert str(err.value).endswith("has no class 'Resnet': it has Block, EdgeNet")


def test_a_module_of_a_package_a_letter_off_is_answered_with_the_packages_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the package imported, its module mistyped: "did you mean '<the package>'", the very name
    # given, was the answer
    package = f"{USER_MODULE}_pkg"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "nets.py").write_text("from torch import nn\n\nNet = nn.Flatten\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in (package, f"{package}.nets"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ConfigError) as err:
        models.resolve(f"{package}.netz:Net")
    assert str(err.value).endswith(f": did you mean '{package}.nets' (a module of {package})?")
    with pytest.raises(ConfigError) as err:  # nothing close: what it has
        models.resolve(f"{package}.layers:Net")
    assert str(err.value).endswith(f": {package} has no module layers (it has: nets)")
    with pytest.raises(ConfigError) as err:  # the class after a dot, not the colon
        models.resolve(f"{package}.nets.Net:Net")
    assert str(err.value).endswith(
        f": {package}.nets is a module, not a package: its class goes after a colon "
        f"({package}.nets:Net)"
    )


def test_a_model_module_in_this_folder_is_put_on_the_path_with_a_dot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `lightship` (a console script) does not import from the current folder
    (tmp_path / f"{USER_MODULE}_here.py").write_text("x = 1\n")
    monkeypatch.chdir(tmp_path)
    importlib.invalidate_caches()  # this folder's listing as it is now (a test before may not)
    with pytest.raises(ConfigError) as err:  # not it, and no close name here either (a name
        models.resolve("unrelated_net:Net")  # that differs only in its end is a close one)
    assert str(err.value).endswith("PYTHONPATH=<folder of unrelated_net.py>")
    monkeypatch.delitem(sys.modules, f"{USER_MODULE}_here", raising=False)
    with pytest.raises(ConfigError) as err:
        models.resolve(f"{USER_MODULE}_here:Net")
    assert str(err.value).endswith("install it, or run with PYTHONPATH=.")


@pytest.mark.parametrize(
    ("source", "error", "line"),
    [
        ("from torch import nn\nclass Net(nn.Module)\n    pass\n", "SyntaxError: expected ':'", 2),
        ("from torch import nn\n\nclass Net(nn.Modle):\n    pass\n", "AttributeError: ", 3),
        ("x = 1\nraise RuntimeError('setup\\nmore')\n", "RuntimeError: setup", 2),
    ],
)
def test_a_model_module_that_fails_to_import_is_one_line_naming_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, error: str, line: int
) -> None:
    module = f"{USER_MODULE}_fails_{line}_{error[:3]}"
    path = tmp_path / f"{module}.py"
    path.write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as err:
        models.resolve(f"{module}:Net")
    message = str(err.value)
    assert message.startswith(f"model '{module}:Net': importing {module} failed: {error}")
    assert message.endswith(f" ({path}, line {line}): fix the module") and "\n" not in message


def test_a_module_that_imports_something_missing_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / f"{USER_MODULE}_needs.py").write_text("import no_such_dependency_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as err:
        models.resolve(f"{USER_MODULE}_needs:Net")
    assert str(err.value).endswith(
        f"(No module named 'no_such_dependency_here'): install what {USER_MODULE}_needs needs, "
        "or fix its imports"
    )


@pytest.mark.parametrize(
    ("name", "channels", "size"), [("digits_cnn", 1, 28), ("resnet", 3, 32), ("mlp", 1, 28)]
)
def test_every_model_scripts_for_the_torchscript_fallback(
    name: str, channels: int, size: int
) -> None:
    # TorchScript export scripts a model whose trace check fails (control flow on values):
    # Normalize's buffer annotations, strings under `from __future__ import annotations`,
    # made that fail for every lightship model ("Unknown type annotation: 'torch.Tensor'")
    model = models.create(
        {
            "name": name,
            "kwargs": {},
            "in_channels": channels,
            "num_classes": 10,
            "image_size": size,
            "mean": [100.0] * channels,
            "std": [50.0] * channels,
        }
    ).eval()
    scripted = torch.jit.script(model)
    x = torch.randint(0, 256, (2, channels, size, size), dtype=torch.uint8)
    with torch.inference_mode():
        torch.testing.assert_close(scripted(x), model(x))


class _DrawsEverywhere(nn.Module):
    """A model whose forward draws from torch's, Python's and numpy's generators."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.5), nn.Linear(784, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import random

        import numpy as np

        random.random()
        np.random.rand()
        return self.head(x.float())


@pytest.mark.parametrize("name", ["digits_cnn", "drawing"])
def test_checking_a_model_before_training_leaves_the_seeded_draws_as_they_were(
    name: str,
) -> None:
    """The training-mode check of the digits model (it ends in Dropout) drew a mask after
    seeding: every later draw moved, and one seed gave two trainings before and after it."""
    import random

    import numpy as np

    from lightship.config import load_config

    fit = importlib.import_module("lightship.train.fit")  # lightship.train.fit: the function
    cfg = load_config(None, None)
    spec = {"name": "digits_cnn", "kwargs": {}, "in_channels": 1, "num_classes": 10,
            "image_size": cfg.data.image_size, "mean": [0.0], "std": [1.0]}  # fmt: skip
    model = models.create(spec) if name == "digits_cnn" else _DrawsEverywhere()

    def draws() -> tuple[list[float], float, float]:
        return torch.rand(3).tolist(), random.random(), float(np.random.rand())

    def seed() -> None:
        torch.manual_seed(0), random.seed(0), np.random.seed(0)

    seed()
    expected = draws()
    seed()
    fit._check_model_trains(model, cfg, 10)
    assert draws() == expected
