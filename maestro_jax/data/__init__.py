"""Data: the sample schema, sample sources and the Grain pipeline that makes global batches."""

from maestro_jax.data.pipeline import BadSamples, global_batches, training_batches
from maestro_jax.data.samples import (
    FIRST_TEXT_TOKEN,
    IMAGE_TOKEN,
    DataError,
    Sample,
    decode_sample,
    encode_sample,
    image_tokens,
    validate_sample,
)
from maestro_jax.data.sources import ArrayRecordSource, SyntheticSource, sample_check, source_from_config

__all__ = ["FIRST_TEXT_TOKEN", "IMAGE_TOKEN", "ArrayRecordSource", "BadSamples", "DataError", "Sample",
           "SyntheticSource", "decode_sample", "encode_sample", "global_batches", "image_tokens", "sample_check",
           "source_from_config", "training_batches", "validate_sample"]
