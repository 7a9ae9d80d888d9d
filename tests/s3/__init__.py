"""A bucket in S3 (a local moto server) mounted with s3fs-fuse as the workdir."""
