"""Data for training: tokenizers, token files, and the Grain pipelines that batch them."""

from dew.lazy import lazy_names

__all__ = ["ByteTokenizer", "ChatData", "Dataset", "HFTokenizer", "Loading", "ModelInputs", "PackedTokens",
           "Partition", "Role", "TokenWindows", "load_tokenizer"]
# Each name imported from its module when first used, so that a module needing one piece (a model's
# `ModelInputs`, a server's tokenizer) does not import Grain's pipelines.
__getattr__, __dir__ = lazy_names(__name__, {
    "Role": "dew.data.chat", "ChatData": "dew.data.chat_data", "Dataset": "dew.data.dataset",
    "Partition": "dew.data.dataset", "ModelInputs": "dew.data.inputs", "ByteTokenizer": "dew.data.tokenizers",
    "HFTokenizer": "dew.data.tokenizers", "load_tokenizer": "dew.data.tokenizers", "Loading": "dew.data.windows",
    "PackedTokens": "dew.data.windows", "TokenWindows": "dew.data.windows"})
