"""Data: the sample schema, sample sources and the Grain pipeline that makes global batches."""

from maestro_jax.data.pipeline import BadSamples, global_batches, training_batches
from maestro_jax.data.samples import (
    AUDIO_TOKEN,
    FIRST_TEXT_TOKEN,
    IMAGE_TOKEN,
    DataError,
    Modality,
    Sample,
    SampleInfo,
    decode_sample,
    encode_sample,
    image_tokens,
    validate_sample,
)
from maestro_jax.data.sources import ArrayRecordSource, SyntheticItems, SyntheticSource, sample_info

__all__ = ["AUDIO_TOKEN", "FIRST_TEXT_TOKEN", "IMAGE_TOKEN", "ArrayRecordSource", "BadSamples", "DataError",
           "Modality", "Sample", "SampleInfo", "SyntheticItems", "SyntheticSource", "decode_sample", "encode_sample",
           "global_batches", "image_tokens", "sample_info", "training_batches", "validate_sample"]
