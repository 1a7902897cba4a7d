"""bgeserve on Ray Data: ``Embedder`` for your own pipelines, and ``bgeserve bulk --ray``.

    import ray
    from bgeserve.ray import Embedder

    ds = ray.data.read_parquet("/data/docs")            # a string column "text"
    ds = ds.map_batches(Embedder, fn_constructor_kwargs={"outputs": "dense,sparse"},
                        batch_format="pyarrow", batch_size=256, concurrency=4, num_cpus=8)
    ds.write_parquet("/data/vectors")

Install with ``pip install 'bgeserve[ray]'``. ``pipeline`` runs ``bgeserve bulk``'s job (same
shards, manifest and resume as the local job) over ``datasource`` → ``Embedder`` →
``datasink``.
"""

from bgeserve.ray.embedder import Embedder

__all__ = ["Embedder"]
