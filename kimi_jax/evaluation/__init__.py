"""Standard benchmarks (MATH-500, AIME, GSM8K, HumanEval, LiveCodeBench,
MBPP, MathVista) read from their published files, sampled and scored with
the k1.5 evaluation protocol (docs/evaluation.md)."""
