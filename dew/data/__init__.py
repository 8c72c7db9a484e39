"""Data for training: tokenizers, token files, and the Grain pipelines that batch them."""

from dew.data.chat import Role
from dew.data.chat_data import ChatData
from dew.data.dataset import Dataset, Partition
from dew.data.inputs import ModelInputs
from dew.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer
from dew.data.windows import Loading, PackedTokens, TokenWindows

__all__ = [
    "ByteTokenizer",
    "ChatData",
    "Dataset",
    "HFTokenizer",
    "Loading",
    "ModelInputs",
    "PackedTokens",
    "Partition",
    "Role",
    "TokenWindows",
    "load_tokenizer",
]
