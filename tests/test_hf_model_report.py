"""scripts/hf_model_report.py, the comparison of two runs of
scripts/hf_model_tests.sh (transformers' own model tests on cpu and on tpu),
on junit XML written here: it counts each run, lists the tests that pass on
the first and fail on the second, those the first skips and the second
fails, and the crashes (no XML, or pytest's exit code past 1)."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "hf_model_report", os.path.join(ROOT, "scripts", "hf_model_report.py"))
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def _xml(path, cases):
    body = []
    for name, outcome, msg in cases:
        inner = {"passed": "", "failed": f'<failure message="{msg}">tb</failure>',
                 "error": f'<error message="{msg}">tb</error>',
                 "skipped": f'<skipped message="{msg}"/>'}[outcome]
        body.append(f'<testcase classname="tests.m.T" name="{name}" time="0.1">{inner}</testcase>')
    path.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest">'
                    + "".join(body) + "</testsuite></testsuites>")


def test_report_lists_cpu_pass_tpu_fail_accelerator_only_failures_and_crashes(tmp_path, capsys):
    _xml(tmp_path / "gpt2.cpu--.xml", [("test_a", "passed", ""), ("test_b", "passed", ""),
                                       ("test_c", "failed", "both"), ("test_d", "skipped", "needs accelerator")])
    _xml(tmp_path / "gpt2.tpu-strict.xml", [("test_a", "passed", ""), ("test_b", "failed", "IndexError: x"),
                                            ("test_c", "failed", "both"), ("test_d", "error", "boom")])
    _xml(tmp_path / "vit.cpu--.xml", [("test_a", "passed", "")])
    (tmp_path / "vit.tpu-strict.log").write_text("Fatal Python error\n")
    (tmp_path / "times.txt").write_text(
        "gpt2 cpu - 1 3\ngpt2 tpu strict 1 5\nvit cpu - 0 2\nvit tpu strict 139 9\n")

    assert report.main([str(tmp_path), "cpu--", "tpu-strict"]) == 1
    out = capsys.readouterr().out
    assert "passed on cpu--, failed on tpu-strict: 1" in out
    assert "- gpt2: tests.m.T::test_b [failed] IndexError: x" in out
    assert "failed on tpu-strict: 1\n- gpt2: tests.m.T::test_d [error] boom" in out
    assert "crashes: 1\n- vit tpu-strict: rc 139 (no junit XML)" in out
    gpt2_cpu = next(line for line in out.splitlines() if line.startswith("gpt2") and "cpu--" in line)
    assert gpt2_cpu.split()[2:8] == ["2", "1", "0", "1", "1", "3"]


def test_report_is_clean_when_the_second_run_fails_only_what_the_first_fails(tmp_path, capsys):
    _xml(tmp_path / "bert.cpu--.xml", [("test_a", "passed", ""), ("test_b", "failed", "old test")])
    _xml(tmp_path / "bert.tpu-fused.xml", [("test_a", "passed", ""), ("test_b", "failed", "old test")])
    assert report.main([str(tmp_path), "cpu--", "tpu-fused", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| bert | tpu-fused | 1 | 1 | 0 | 0 | - | - |" in out
    assert "failed on tpu-fused: 0" in out and "crashes: 0" in out
