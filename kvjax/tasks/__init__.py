"""Long-context task generators (prompts with known answers) and local datasets."""

from kvjax.tasks.dataset import dataset_samples
from kvjax.tasks.documents import Document
from kvjax.tasks.documents import example_document
from kvjax.tasks.niah import TASKS
from kvjax.tasks.niah import make_sample
from kvjax.tasks.passkey import passkey_prompt
from kvjax.tasks.sample import Sample

__all__ = ["Document", "Sample", "TASKS", "dataset_samples", "example_document", "make_sample",
           "passkey_prompt"]
