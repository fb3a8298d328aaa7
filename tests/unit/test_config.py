from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
import yaml

from lightship.config import Config, load_config, revalidated
from lightship.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["digits.yaml", "tiny.yaml", "resnet.yaml"])
def test_shipped_configs_load(name: str) -> None:
    cfg = load_config(CONFIGS / name)
    assert isinstance(cfg, Config)


def test_digits_yaml_is_the_defaults_written_out() -> None:
    # digits.yaml lists every key; it must not drift from the defaults in config.py
    # except where it says so (accelerator auto is the default too).
    assert load_config(CONFIGS / "digits.yaml") == Config()
    written = yaml.safe_load((CONFIGS / "digits.yaml").read_text())
    for section, keys in Config().model_dump().items():
        missing = set(keys) - set(written[section]) if isinstance(keys, dict) else set()
        assert not missing, f"digits.yaml leaves out {section}: {sorted(missing)}"


def test_dotted_overrides_are_typed() -> None:
    cfg = load_config(
        CONFIGS / "tiny.yaml",
        ["trainer.max_epochs=3", "optim.lr=0.5", "model.kwargs={widths: [4]}"],
    )
    assert cfg.trainer.max_epochs == 3
    assert cfg.optim.lr == 0.5
    assert cfg.model.kwargs == {"widths": [4]}
    assert cfg.data.image_size == 16  # from tiny.yaml, untouched
    # one override as a string, not a list: it was read a character at a time ("--set 't'")
    assert load_config(CONFIGS / "tiny.yaml", "trainer.max_epochs=2").trainer.max_epochs == 2


def test_unknown_key_names_key_and_allowed_keys() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.max_epoch=3"])
    msg = str(err.value)
    assert "unknown key 'trainer.max_epoch'" in msg
    assert "max_epochs" in msg and "precision" in msg
    assert "\n" not in msg


def test_unknown_section_lists_sections() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainr.max_epochs=3"])
    assert "unknown key 'trainr'" in str(err.value)
    assert "trainer" in str(err.value)


def test_wrong_type_names_key_value_and_fix() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.max_epochs=lots"])
    msg = str(err.value)
    assert "'trainer.max_epochs' = 'lots'" in msg
    assert "integer" in msg and "--set trainer.max_epochs=" in msg


@pytest.mark.parametrize("key", ["trainer.max_epochs", "optim.lr", "trainer.devices", "seed"])
def test_true_or_false_for_a_number_is_refused_not_taken_as_1_or_0(key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}=true"])
    assert str(err.value) == (
        f"--set: '{key}' = True: Input should be a number, not true/false; fix it with "
        f"--set {key}=..."
    )
    assert load_config(None, ["data.augment=false"]).data.augment is False  # a yes/no key


@pytest.mark.parametrize(
    ("setting", "choices"),
    [
        ("trainer.progress_bar=false", "'auto', 'rich' or 'none'"),
        ("data.source=no", "'digits', 'folder' or 'npz'"),
        ("data.channels=yes", "1 or 3"),
        ("trainer.profiler=off", "'simple', 'advanced' or 'pytorch'"),  # or null: a union
    ],
)
def test_a_word_yaml_reads_as_true_or_false_for_a_choice_names_the_choices(
    setting: str, choices: str
) -> None:
    # it said "Input should be a number, not true/false" of a key that takes names
    key, _, word = setting.partition("=")
    with pytest.raises(ConfigError) as err:
        load_config(None, [setting])
    value = {"false": False, "no": False, "off": False, "yes": True}[word]
    assert str(err.value) == (
        f"--set: '{key}' = {value}: Input should be {choices}, not true/false (YAML reads "
        f"true/false, yes/no and on/off as such); fix it with --set {key}=..."
    )


@pytest.mark.parametrize("setting", ["model.name=no", "data.path=off", "model.kwargs=no"])
def test_a_word_yaml_reads_as_true_or_false_for_text_says_to_quote_it(setting: str) -> None:
    # it said "Input should be a number, not true/false" of keys that take a name, a path or a
    # mapping
    key, _, _ = setting.partition("=")
    with pytest.raises(ConfigError) as err:
        load_config(None, [setting, "data.source=folder"])
    wanted = (
        "a mapping {key: value}, not true/false"
        if key == "model.kwargs"
        else "text, not true/false (YAML reads true/false, yes/no and on/off as such): quote the "
        "word to keep it text, as \"'off'\""
    )
    assert str(err.value) == (
        f"--set: '{key}' = False: Input should be {wanted}; fix it with --set {key}=..."
    )
    if key == "model.name":  # quoted, it is the text
        assert load_config(None, [f"{key}='off'"]).model.name == "off"


def test_bad_literal_lists_choices() -> None:
    with pytest.raises(ConfigError, match="'32', 'bf16-mixed' or '16-mixed'"):
        load_config(None, ["trainer.precision=64"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("checkpoint.monitor=val_los", "Input should be 'val_acc' or 'val_loss'"),
        ("early_stopping.monitor=acc", "Input should be 'val_acc' or 'val_loss'"),
        ("trainer.limit_val_batches=0", "greater than 0"),
    ],
)
def test_settings_lightning_checks_only_while_fitting_are_checked_here(
    override: str, message: str
) -> None:
    # Lightning finds these once the first validation ends, after the run directory changed
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("seed=-1", "'seed' = -1: Input should be greater than or equal to 0"),
        (
            "seed=4294967296",
            "'seed' = 4294967296: Input should be less than or equal to 4294967295",
        ),
        ("data.split_seed=-2", "'data.split_seed' = -2: Input should be greater than or equal"),
    ],
)
def test_a_seed_numpy_cannot_take_is_refused_by_its_key(override: str, message: str) -> None:
    # Lightning's seed_everything raised numpy's ValueError as a traceback, after the data loaded
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_thousands_of_data_loader_workers_are_refused_before_training() -> None:
    # each worker is a process: data.num_workers=9999 ran the machine out of memory and the
    # kernel's kill left orphaned workers behind
    fit = importlib.import_module("lightship.train.fit")  # the package exports fit()
    cpus = os.cpu_count() or 1
    fit._check_runtime_config(load_config(None, [f"data.num_workers={4 * cpus}"]))  # allowed
    with pytest.raises(ConfigError) as err:
        fit._check_runtime_config(load_config(None, ["data.num_workers=9999"]))
    assert str(err.value) == (
        f"data.num_workers=9999 starts that many processes on a {cpus}-CPU machine: use 0 to "
        f"{4 * cpus} (0 loads in the training process)"
    )


def test_an_accelerator_lightship_cannot_use_lists_the_ones_it_can() -> None:
    # Lightning's own refusal of tpu said to install torch_xla, which would not make it work
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.accelerator=tpu"])
    assert str(err.value) == (
        "--set: 'trainer.accelerator' = 'tpu': Input should be 'auto', 'cpu', 'gpu' "
        "or 'cuda'; fix it with --set trainer.accelerator=..."
    )


def test_a_value_yaml_read_otherwise_than_meant_says_how_to_write_it() -> None:
    # `model.mean=0.5`: a list is wanted, one value per channel
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.mean=0.5"])
    assert str(err.value) == (
        "--set: 'model.mean' = 0.5: Input should be a valid list; fix it with --set "
        "'model.mean=[0.5]'"
    )
    # `model.name=mynet:`: YAML read the colon as a mapping
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.name=mynet:"])
    assert str(err.value) == (
        "--set: 'model.name' = {'mynet': None}: Input should be a valid string (YAML read "
        "'mynet:' as a mapping: quote it, --set 'model.name=\"mynet:\"'); fix it with --set "
        "model.name=..."
    )
    assert load_config(None, ['model.name="mynet:"']).model.name == "mynet:"


def test_a_bad_value_is_named_by_its_own_source_not_every_override(tmp_path: Path) -> None:
    # it said "configs/tiny.yaml + --set + --set + --set + --set:", whichever gave the value
    tiny = str(CONFIGS / "tiny.yaml")
    many = ["trainer.max_epochs=1", "seed=1", "optim.lr=0.1"]
    with pytest.raises(ConfigError) as err:
        load_config(tiny, [*many, "data.image_size=[16, 20]"])
    assert str(err.value) == (
        "--set: 'data.image_size' = [16, 20]: Input should be a valid integer; "
        "fix it with --set data.image_size=..."
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  image_size: [16, 20]\n  colour: true\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad, many)
    assert str(err.value) == (
        f"{bad}: 'data.image_size' = [16, 20]: Input should be a valid integer (and 1 more); "
        f"fix it in {bad} or with --set data.image_size=..."
    )
    with pytest.raises(ConfigError) as err:  # an unknown key: where it was written
        load_config(bad, [*many, "data.image_size=16"])
    assert str(err.value).startswith(f"{bad}: unknown key 'data.colour'; allowed in data: ")
    with pytest.raises(ConfigError) as err:
        load_config(tiny, [*many, "data.colour=1"])
    assert str(err.value).startswith("--set: unknown key 'data.colour'; allowed in data: ")


def test_sources_name_where_each_key_came_from(tmp_path: Path) -> None:
    cfg = load_config(CONFIGS / "tiny.yaml", ["model.name=mlp", "trainer.max_epochs=1"])
    tiny = str(CONFIGS / "tiny.yaml")
    assert cfg.sources.of("model.kwargs") == tiny
    assert cfg.sources.of("model.name") == "--set"
    assert cfg.sources.of("optim.lr") == "defaults"
    assert cfg.sources.in_file("model.name", "digits_cnn") == "digits_cnn"
    mixed = load_config(CONFIGS / "tiny.yaml", ["model.kwargs.dropout=0.1"])
    assert mixed.sources.of("model.kwargs") == f"{tiny} + --set"
    # where the values came from is no part of the config
    assert load_config(None, ["seed=0"]) == load_config(CONFIGS / "digits.yaml") == Config()


def test_set_without_equals() -> None:
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(None, ["trainer.max_epochs"])


def test_missing_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    broken = tmp_path / "broken.yaml"
    broken.write_text("data: {source: [\n")
    with pytest.raises(ConfigError, match="not valid YAML") as err:
        load_config(broken)
    assert str(err.value).endswith("line 2, column 1")  # the line to fix is the fix
    # a run's own config.yaml, read to resume, is no file to edit: how to go on instead
    with pytest.raises(ConfigError) as err:
        load_config(broken, unusable_fix="restore it, or train afresh")
    assert str(err.value).endswith("line 2, column 1: restore it, or train afresh")


def test_yaml_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"data:\n  source: d\xefgits\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text .*save it as UTF-8"):
        load_config(path)


def test_yaml_syntax_error_names_problem_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "tab.yaml"
    path.write_text("data:\n\timage_size: 20\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "found character '\\t' that cannot start any token at line 2, column 1" in msg
    assert "\n" not in msg


def test_a_key_written_twice_is_refused(tmp_path: Path) -> None:
    # YAML keeps the last value silently: the edit on line 3 would be undone by line 4.
    path = tmp_path / "twice.yaml"
    path.write_text("optim:\n  lr: 0.05\n  weight_decay: 0.0\n  lr: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert msg == (
        f"{path} is not valid YAML: key 'lr' appears twice in one section (keep one) "
        "at line 4, column 3"
    )
    with pytest.raises(ConfigError, match="key 'x' appears twice"):
        load_config(None, ["model.kwargs={x: 1, x: 2}"])
    # The same key in different sections, and a merge key beside its overrides, are fine.
    ok = tmp_path / "ok.yaml"
    ok.write_text("optim:\n  lr: 0.05\ntrainer:\n  max_epochs: 2\n")
    assert load_config(ok).optim.lr == 0.05
    assert load_config(None, ["model.kwargs={<<: {a: 1}, a: 2}"]).model.kwargs == {"a": 2}


def test_empty_yaml_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="empty.yaml is empty: write the sections to change"):
        load_config(path)
    # a run's own config.yaml, read by `train --resume`: the fix is the caller's
    with pytest.raises(ConfigError) as err:
        load_config(path, unusable_fix="restore it")
    assert str(err.value) == f"{path} is empty: restore it"


def test_config_path_that_is_a_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a folder, not a YAML file"):
        load_config(tmp_path)


def test_config_path_that_is_no_regular_file_is_not_called_missing(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # read, it would block until a writer came
    for path in (fifo, Path("/dev/null")):
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert str(err.value) == (
            f"config {path} is not a regular file: pass a YAML file, e.g. --config "
            "configs/digits.yaml"
        )
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "missing.yaml")
    # no relative configs/digits.yaml, which exists only in the checkout
    assert str(err.value) == (
        f"config file {tmp_path / 'missing.yaml'} not found: pass an existing YAML file, or "
        "leave --config out for the defaults (configs/digits.yaml's)"
    )


def test_malformed_yaml_in_set_names_the_set() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.kwargs={x: 1"])
    msg = str(err.value)
    assert msg.startswith("--set 'model.kwargs={x: 1': the value is not valid YAML")
    assert "line 1, column 6" in msg and "\n" not in msg


def test_mean_std_need_one_value_per_channel() -> None:
    with pytest.raises(ConfigError, match="model.mean has 2 values but data.channels is 1"):
        load_config(None, ["model.mean=[0.5, 0.5]"])
    with pytest.raises(ConfigError, match="model.std has 1 values but data.channels is 3"):
        load_config(None, ["data.channels=3", "model.std=[50]"])
    assert load_config(None, ["data.channels=3", "model.mean=[1, 2, 3]"]).model.mean == [1, 2, 3]


def test_std_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="'model.std' = \\[0\\].*every std must be > 0"):
        load_config(None, ["model.std=[0]"])


@pytest.mark.parametrize(("path", "source"), [("/data/shapes", "folder"), ("d.NPZ", "npz")])
def test_a_data_path_without_its_source_is_refused(path: str, source: str) -> None:
    # data.path alone trained on the built-in digits, and recorded the path beside them
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "digits.yaml", [f"data.path={path}"])
    assert str(err.value) == (
        f"data.path={path} is set but data.source is digits (the built-in images), which "
        f"reads no path: add --set data.source={source}, or drop data.path"
    )
    assert load_config(None, [f"data.path={path}", f"data.source={source}"]).data.source == source


@pytest.mark.parametrize("given", [[], ["data.path="]])
@pytest.mark.parametrize("source", ["folder", "npz"])
def test_a_source_without_its_data_path_is_a_config_error(source: str, given: list[str]) -> None:
    # refused as the data was read (DataError: exit 3, "data"), where its mirror image, a path
    # without its source, is exit 2 (configuration)
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"data.source={source}", *given])
    assert str(err.value) == f"data.source={source} needs data.path (--set data.path=...)"
    # in Python, set one at a time in that order, then checked whole (as `fit` does)
    cfg = load_config(None)
    cfg.data.source = source  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="needs data.path"):
        revalidated(cfg)
    cfg.data.path = Path("d.npz" if source == "npz" else "shapes")
    assert revalidated(cfg).data.source == source
    cfg = load_config(None)  # and the other way round
    cfg.data.path = Path("d.npz" if source == "npz" else "shapes")
    with pytest.raises(ConfigError, match="is set but data.source is digits"):
        revalidated(cfg)
    cfg.data.source = source
    assert revalidated(cfg).data.source == source


def test_a_runs_older_config_with_a_path_beside_digits_reads_as_digits(tmp_path: Path) -> None:
    # before data.path needed its source, runs recorded it beside digits in config.yaml;
    # `train --resume` read it with the new check and refused the run
    written = tmp_path / "config.yaml"
    written.write_text("data:\n  source: digits\n  path: /home/u/mydata.npz\n")
    cfg = load_config(written, recorded=True)
    assert (cfg.data.source, cfg.data.path) == ("digits", None)
    assert cfg.sources.notes == (
        f"note: {written} records data.path=/home/u/mydata.npz beside data.source digits, as "
        "older lightship versions allowed; digits reads no path, so it is left out",
    )
    # what a user gives is checked as before: the file as a --config, or a path on --set
    with pytest.raises(ConfigError, match="data.path=/home/u/mydata.npz is set but data.source"):
        load_config(written)
    with pytest.raises(ConfigError, match="data.path=/x.npz is set but data.source is digits"):
        load_config(written, ["data.path=/x.npz"], recorded=True)
    assert load_config(CONFIGS / "digits.yaml", recorded=True).sources.notes == ()


def test_mean_and_std_in_0_to_1_are_refused_with_them_in_pixel_units() -> None:
    # ImageNet's [0.485, ...] / [0.229, ...] were taken as they are for 0..255 pixels
    imagenet = ["model.mean=[0.485, 0.456, 0.406]", "model.std=[0.229, 0.224, 0.225]"]
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.channels=3", *imagenet])
    assert str(err.value) == (
        "model.mean/std are in pixel units 0..255 (the model normalises uint8 images), but every "
        "value given is at most 1, as for images scaled to 0..1: multiply them by 255 (--set "
        "'model.mean=[123.675, 116.28, 103.53]' --set 'model.std=[58.395, 57.12, 57.375]'), or "
        "leave them out to measure them on the training images"
    )
    with pytest.raises(ConfigError, match="--set 'model.std=\\[127.5\\]'\\)"):
        load_config(None, ["model.std=[0.5]"])
    raw = load_config(None, ["model.mean=[0]", "model.std=[1]"])  # no normalisation: taken
    assert (raw.model.mean, raw.model.std) == ([0.0], [1.0])


def test_a_minimum_of_epochs_over_the_maximum_is_refused(tmp_path: Path) -> None:
    # Lightning took it and trained max_epochs: the minimum asked for never ran
    with pytest.raises(ConfigError, match="trainer.min_epochs=10 is more than trainer.max_epoch"):
        load_config(None, ["trainer.min_epochs=10", "trainer.max_epochs=4"])
    # judged on the whole config, not key by key: a file's 5..10 lowered to 2..4 is fine
    path = tmp_path / "epochs.yaml"
    path.write_text("trainer:\n  min_epochs: 5\n  max_epochs: 10\n")
    cfg = load_config(path, ["trainer.max_epochs=4", "trainer.min_epochs=2"])
    assert (cfg.trainer.min_epochs, cfg.trainer.max_epochs) == (2, 4)


def test_a_runs_config_yaml_records_data_path_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `--set data.path=data` was written as typed: `--resume` from another folder read another
    # `data` and refused the checkpoints, which record it absolute, as another run's
    from lightship.config import dump_config

    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["data.source=folder", "data.path=data"])
    written = yaml.safe_load(dump_config(cfg))
    assert written["data"]["path"] == str(tmp_path / "data")
    assert cfg.data.path == Path("data")  # the config itself keeps what was given
    assert dump_config(load_config(None)).count("path: null") == 1  # digits: no path


def test_a_config_changed_by_assignment_is_checked_whole_before_training(
    tmp_path: Path,
) -> None:
    # assignment checks a value against its field only: fit trained with a 0..1 mean and
    # wrote a config.yaml that lightship then refused
    from lightship.config import revalidated
    from lightship.runs import RunDir
    from lightship.train import fit

    cfg = load_config(None)
    cfg.model.mean, cfg.model.std = [0.13], [0.31]
    with pytest.raises(ConfigError, match=r"model.mean.*pixel units 0..255"):
        revalidated(cfg)
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"pixel units 0..255"):
        fit(cfg, RunDir(run))
    assert not (run / "config.yaml").exists()
    wide = load_config(None, ["model.mean=[100]", "model.std=[50]"])
    wide.data.channels = 3
    with pytest.raises(ConfigError, match="model.mean has 1 values but data.channels is 3"):
        revalidated(wide)
    assert revalidated(load_config(None, ["seed=7"])).sources.overrides == (("seed",),)


@pytest.mark.parametrize(
    "path", ["/d/plain", "/d/my data", "/d/Pets #2", "/d/Cats: Dogs", "/d/it's", "/d/😀 #x"]
)
def test_a_set_arg_in_a_message_reads_back_as_its_value(path: str) -> None:
    """A fix's `--set data.path=...`, pasted: ' #' began a YAML comment and ': ' a mapping."""
    import shlex

    from lightship.config import set_arg

    flag, arg = shlex.split(set_arg("data.path", path))
    assert flag == "--set"
    cfg = load_config(CONFIGS / "tiny.yaml", ["data.source=folder", arg])
    assert str(cfg.data.path) == path


def test_a_monitors_mode_follows_it_and_one_given_against_it_is_refused() -> None:
    """`checkpoint.monitor=val_loss` alone kept mode max: best.ckpt was the epoch of the
    highest loss. `early_stopping.monitor=val_acc` alone stopped a training whose accuracy
    rose, as not improving (mode min)."""
    cfg = load_config(None, ["checkpoint.monitor=val_loss", "early_stopping.monitor=val_acc"])
    assert (cfg.checkpoint.direction, cfg.early_stopping.direction) == ("min", "max")
    defaults = load_config(None)
    assert (defaults.checkpoint.direction, defaults.early_stopping.direction) == ("max", "min")
    assert load_config(None, ["checkpoint.mode=max"]).checkpoint.direction == "max"  # agrees
    for section, monitor, mode, better in (
        ("checkpoint", "val_loss", "max", ("lower", "min")),
        ("early_stopping", "val_acc", "min", ("higher", "max")),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"{section}.monitor={monitor}", f"{section}.mode={mode}"])
        assert str(err.value) == (
            f"{section}.mode={mode} with {section}.monitor={monitor}, which is better "
            f"{better[0]}: set {section}.mode={better[1]}, or leave mode out (it follows the "
            "monitor)"
        )


def test_a_top_k_of_no_checkpoint_is_refused() -> None:
    # Lightning kept none, and best.ckpt was last.ckpt, the manifest's val_acc null
    with pytest.raises(ConfigError, match=r"checkpoint.save_top_k=0 keeps no checkpoint"):
        load_config(None, ["checkpoint.save_top_k=0"])
    assert load_config(None, ["checkpoint.save_top_k=-1"]).checkpoint.save_top_k == -1


@pytest.mark.parametrize(
    ("overrides", "env", "refused"),
    [
        # ddp_spawn trained in its own processes: "trained in 4.4 s (0 epochs, step 0)"
        (["trainer.strategy=ddp_spawn"], {}, "trainer.strategy=ddp_spawn trains in processes"),
        (["trainer.strategy=ddp_notebook"], {}, "trainer.strategy=ddp_notebook trains in"),
        (["trainer.strategy=ddp"], {}, None),
        # one device trained, and the manifest said devices 2
        (
            ["trainer.devices=2", "trainer.strategy=single_device"],
            {},
            "trainer.strategy=single_device trains on",
        ),
        # waited for the other node for ever, deaf to SIGTERM and Ctrl-C
        (["trainer.num_nodes=2"], {}, "trainer.num_nodes=2 needs the command started on every"),
        (["trainer.num_nodes=2"], {"MASTER_ADDR": "10.0.0.1"}, None),
        (["trainer.num_nodes=2"], {"SLURM_NTASKS": "4"}, None),
    ],
)
def test_strategies_that_would_train_unrecorded_or_wait_for_ever_are_refused(
    monkeypatch: pytest.MonkeyPatch, overrides: list[str], env: dict[str, str], refused: str | None
) -> None:
    fit = importlib.import_module("lightship.train.fit")
    for key in ("MASTER_ADDR", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = load_config(None, overrides)
    if refused is None:
        fit._check_runtime_config(cfg)
        return
    with pytest.raises(ConfigError) as err:
        fit._check_runtime_config(cfg)
    assert str(err.value).startswith(refused)


@pytest.mark.parametrize(
    ("override", "said"),
    [
        # a union's arm and a list's index were named as keys: `--set trainer.devices.int=...`
        (
            "trainer.devices=null",
            "--set: 'trainer.devices' = None: Input should be a valid integer or a valid "
            "string; fix it with --set trainer.devices=...",
        ),
        ("model.mean=[a]", "; fix it with --set model.mean=..."),
        # a section given a value: "Input should be a number, not true/false"
        (
            "early_stopping=false",
            "--set: 'early_stopping' is a section of settings, not a value (False): set its "
            "keys, e.g. --set early_stopping.enabled=... (it has: enabled, monitor, mode, "
            "patience, min_delta)",
        ),
    ],
)
def test_a_bad_value_names_the_key_it_was_given_for(override: str, said: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).endswith(said), str(err.value)


def test_auto_on_several_devices_in_an_interactive_session_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """There Lightning makes `auto` its ddp_fork: the forks trained, and the run was recorded
    as trained for 0 epochs, as ddp_spawn's was."""
    from pytorch_lightning.trainer.connectors import accelerator_connector

    fit = importlib.import_module("lightship.train.fit")
    monkeypatch.setattr(accelerator_connector, "_IS_INTERACTIVE", True)
    with pytest.raises(ConfigError) as err:
        fit._trainer(accelerator="cpu", devices=2, strategy="auto", logger=False)
    assert str(err.value).startswith(
        "trainer.strategy=auto with trainer.devices=2 trains in processes Lightning starts"
    )
    monkeypatch.setattr(accelerator_connector, "_IS_INTERACTIVE", False)  # from a shell: ddp
    fit._trainer(accelerator="cpu", devices=2, strategy="auto", logger=False)


def test_a_runs_older_config_with_a_mode_against_its_monitor_loads_with_a_note(
    tmp_path: Path,
) -> None:
    """Written before the mode followed the monitor (`monitor: val_loss` beside the `mode: max`
    it kept): the run's resume was refused, and QAT loaded its data with the defaults."""
    written = tmp_path / "config.yaml"
    tree = {"checkpoint": {"monitor": "val_loss", "mode": "max", "save_top_k": 2}}
    tree["early_stopping"] = {"monitor": "val_loss", "mode": "min"}  # agrees: kept as written
    written.write_text(yaml.safe_dump(tree))
    cfg = load_config(written, recorded=True)
    assert cfg.checkpoint.mode is None and cfg.checkpoint.direction == "min"
    assert cfg.early_stopping.mode == "min"
    assert cfg.sources.notes == (
        f"note: {written} records checkpoint.mode=max with checkpoint.monitor=val_loss, as older "
        "lightship versions left it (the highest val_loss counted as the best); the mode follows "
        "the monitor now (min)",
    )
    with pytest.raises(ConfigError, match="checkpoint.mode=max with checkpoint.monitor=val_loss"):
        load_config(written)  # a --config of the user's own: said, to be fixed there


def test_a_key_yaml_read_as_a_number_is_named_in_its_section(tmp_path: Path) -> None:
    # `7: x` under data: was "'data' is a section of settings, not a value (7)"
    written = tmp_path / "numbers.yaml"
    written.write_text("data:\n  batch_size: 3\n  7: x\n")
    with pytest.raises(ConfigError) as err:
        load_config(written)
    assert str(err.value).startswith(
        f"{written}: unknown key 7 in data (YAML read it as a number); allowed in data: source, "
    )


def test_worker_settings_without_workers_are_refused() -> None:
    # DataLoader takes them only with worker processes: they were dropped without a word
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.persistent_workers=true", "data.prefetch_factor=4"])
    assert str(err.value) == (
        "data.persistent_workers=true and data.prefetch_factor=4 apply to worker processes, and "
        "data.num_workers=0 loads in the training process: set data.num_workers (e.g. 2), or "
        "leave them out"
    )
    cfg = load_config(None, ["data.persistent_workers=true", "data.num_workers=2"])
    assert cfg.data.persistent_workers
