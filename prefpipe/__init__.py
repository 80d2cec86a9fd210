"""prefpipe: the console command (`prefpipe`, prefpipe/cli.py) over the pipeline's stages and workflow."""
