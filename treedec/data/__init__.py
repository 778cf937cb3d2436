"""Data: corpora, tokenizer training, token caches, chat rendering, data modules and prompt sets.

One job per module, importing only downward (``tests/test_layout.py`` checks it):

* :mod:`~treedec.data.files`: content fingerprints and the one atomic write-then-rename helper;
* :mod:`~treedec.data.corpus`: the stdlib corpus listing and its split, and JSON-lines records;
* :mod:`~treedec.data.tokenizer_train`: the byte-level BPE trained on a corpus, and tokenizer loading;
* :mod:`~treedec.data.chat`: conversations rendered to text plus the assistant spans (the trained part);
* :mod:`~treedec.data.token_cache`: corpora tokenised once into memory-mapped files, reused afterwards;
* :mod:`~treedec.data.datasets`: windows and conversations read from those files;
* :mod:`~treedec.data.datamodules`: the Lightning data modules, their sampler and resumable loader;
* :mod:`~treedec.data.prompts`: held-out prompts and prompt files (bench, calibrate, generate, train).
"""
