"""Exercises on the numbered files, with an autograder that runs your code inside the real machinery.

    python3 -m exercises list                      # every exercise, its reading, its planted bugs
    python3 -m exercises check 01                  # grade exercises/ex01_tensor_parallel.py
    python3 -m exercises check 01.3 02             # one exercise, and every one of 02
    python3 -m exercises check all --solution      # the numbered files' own functions: all pass
    python3 -m exercises check 01 --planted g_backward_all_reduces   # what a known mistake looks like
    python3 -m exercises check all --json results.json               # and a Gradescope-style results.json

One stub file per numbered file with exercises (FILES: ex01_tensor_parallel.py ... ex09_expert_parallel.py) holds the
functions and autograd Functions a student writes, each with the signature and the docstring contract of the
piece it replaces and a body that raises NotImplementedError with a hint: the paper section to read
and the command to run. The solutions are the numbered files themselves; nothing here copies them.

How a check works (autograder.py; each file's checks in checks_0N.py): the student's function is
put in place of the numbered file's in this process, the serial model's answer having been computed
first; CPU ranks are forked with gloo, as the tests do, and inherit it; each rank compares what the
parallel code gives with the serial model's answer in float64 (tolerance 1e-10), and says for every
difference which rank, which tensor, how far off, in which direction, and what usually causes it.
Pure pieces (the schedules, the rank grid) are checked here without ranks, through 02's validator
and simulator. Every function graded is wrapped first (autograder.guarded): what it returns is
checked as it returns (None, a backward's number of gradients, their shapes and dtypes, an input
written in place), and a broken rule fails at the student's own line, with the rule.
"""
import importlib
import inspect

# file: (numbered module, stub module, checks module)
FILES = {
    "01": ("01_tensor_parallel", "ex01_tensor_parallel", "checks_01"),
    "02": ("02_pipeline_1f1b", "ex02_pipeline_1f1b", "checks_02"),
    "03": ("03_interleaved", "ex03_interleaved", "checks_03"),
    "04": ("04_data_parallel", "ex04_data_parallel", "checks_04"),
    "05": ("05_3d_gpt", "ex05_3d_gpt", "checks_05"),
    "06": ("06_zero_bubble", "ex06_zero_bubble", "checks_06"),  # 06 and 07: weeks 2 and 4's extra credit
    "07": ("07_vocab_parallel", "ex07_vocab_parallel", "checks_07"),
    "08": ("08_context_parallel", "ex08_context_parallel", "checks_08"),
    "09": ("09_expert_parallel", "ex09_expert_parallel", "checks_09"),
}


def exercises(file):
    """The Exercise records of one numbered file ("01" ... "09"), in order."""
    return importlib.import_module(f"exercises.{FILES[file][2]}").EXERCISES


def stub(file):
    """The stub module a student edits for that file."""
    return importlib.import_module(f"exercises.{FILES[file][1]}")


def writes(exercise):
    """What the student writes for an exercise, in words: each stub function, or each method of a
    stub class ("CopyToTP.forward and .backward"), and the numbered file's piece it stands in for
    where the names differ."""
    module, out = stub(exercise.file), []
    for name, target in zip(exercise.functions, exercise.replaces or exercise.functions):
        obj = getattr(module, name)
        if isinstance(obj, type):  # an autograd Function: the methods the stub defines
            methods = [m for m, v in vars(obj).items() if isinstance(v, (staticmethod, classmethod))
                       or inspect.isfunction(v)]
            text = f"{name}.{' and .'.join(methods)}"
        else:
            text = name
        out.append(text if target == name else f"{text} (in place of {exercise.file}'s {target})")
    return ", ".join(out)


def student_impl(exercise):
    """The student's functions for an exercise, read from its file's stub module."""
    module = stub(exercise.file)
    return {name: getattr(module, name) for name in exercise.functions}
