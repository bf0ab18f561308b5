"""REAL (issue 23): RPA-SFT and pivot-guided decoding for knowledge-intensive VQA."""
