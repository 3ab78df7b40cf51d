"""Data: the sample schema, sample sources and the Grain pipeline that makes global batches."""

from maestro_jax.data.pipeline import BadSamples, BatchReader, LoadedBatch, ReadPlan, global_batches
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
    text_ids,
    validate_info,
    validate_sample,
)
from maestro_jax.data.sources import ArrayRecordSource, SyntheticItems, SyntheticSource, sample_info, write_index

__all__ = [
    "AUDIO_TOKEN",
    "FIRST_TEXT_TOKEN",
    "IMAGE_TOKEN",
    "ArrayRecordSource",
    "BadSamples",
    "BatchReader",
    "DataError",
    "LoadedBatch",
    "Modality",
    "ReadPlan",
    "Sample",
    "SampleInfo",
    "SyntheticItems",
    "SyntheticSource",
    "decode_sample",
    "encode_sample",
    "global_batches",
    "image_tokens",
    "sample_info",
    "text_ids",
    "validate_info",
    "validate_sample",
    "write_index",
]
