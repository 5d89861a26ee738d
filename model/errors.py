"""The engine's errors: what a caller (the command line, a library user) reports to the user as one line."""


class ModelLoadError(Exception):
    """A model file or directory cannot be read: missing, corrupt, or of an architecture we do not run."""


class InputError(Exception):
    """An input that cannot be used as given: empty, undecodable, longer than the context, larger than the memory
    available, or an indexer file that does not fit the model."""


class SettingsError(ValueError):
    """A setting the engine cannot run with (an attention mode, an index dtype, IndexPool's knobs)."""


class ModelOutputError(Exception):
    """The model computed logits that are not numbers (NaN or infinity): weights that hold them, or a dtype too
    narrow for the model's activations."""
