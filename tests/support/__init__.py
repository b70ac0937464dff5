"""Helpers the tests share: paths and the conversion CLI, converted test models, in-process and subprocess
servers, a fake engine and tokenizer, engine helpers, the stateful reference, JSON schemas and kustomize
builds. Test modules import from here, never from each other."""
