"""What every trainer shares: the chunked step and its memory plan, config fields, resume, input and reward checks."""
