"""Words that make a file worth analysing (no import: the runner reads them before libcst loads)."""

#: a file that contains none of these (case aside) is only checked for syntax, with Python's own
#: parser, not analysed: every rule needs a training step, an optimizer, AMP or a half cast (the
#: runner skips such files; the engine reads a project's modules only when they have one)
TRAINING_WORDS = ("backward", "optim", "amp", "autocast", "gradscaler", "half", "float16", "init_process_group")
#: what a project's module must mention, on several processes, to be read for side effects that
#: would run on each process (a progress bar written to stdout, a hand-written download, a print)
SIDE_EFFECT_WORDS = ("stdout", "stderr", "tqdm", "urlretrieve", "extractall", "download", "print(")
