"""The knowledge side: KB files -> SQLite + FAISS index -> retrieval of causes.

- kb: the cause and thread schema, loading and linting the KB files;
- files: the KB's files and content hash;
- index: compiling the KB into one SQLite file (FTS5 + FAISS blob);
- embed, onnxembed: the sentence-transformers model and its ONNX export;
- textsearch: tokens for the lexical signal (Latin words, CJK bigrams);
- retrieve: the five signals fused into a ranking of causes;
- reports: the fourth signal, a model of the labelled real reports (n-grams and vectors);
- neighbours: the fifth, the labelled reports nearest the question's vector;
- refines: a special case taking its general cause's error (kb Cause.refines);
- engine: loads index and model once, answers many questions;
- stats, evaluate: coverage and retrieval quality for KB maintainers.
"""
