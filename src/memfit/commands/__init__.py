"""The ``memfit`` verbs, one module each (``memfit.commands.<verb>``): the verb's flags and what it
does with them, a thin layer over the Python API. :mod:`memfit.cli` registers them; a verb's module
is imported only when that verb runs (or shows its ``--help``), so each starts no slower than it
must. Flags that mirror a field of :class:`memfit.job.Job` or :class:`memfit.train.TrainConfig`
are generated from the field (:mod:`memfit.commands._options`)."""
