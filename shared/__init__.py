"""What the API and the workers both import: settings, Redis key names and the job/result protocol."""
