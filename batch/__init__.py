"""The batch runner: RQ's worker (`python -m batch`) and the job that sends a batch's requests through the API."""
