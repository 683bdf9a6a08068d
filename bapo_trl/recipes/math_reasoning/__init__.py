"""The math-reasoning recipe: dataset formats (``data``), boxed-answer rewards (``rewards``), avg@k / pass@k
evaluation (``evaluate``: ``bapo evaluate``) and the shipped chat arithmetic task
(``chat_arithmetic``). The trainer imports nothing from here."""
