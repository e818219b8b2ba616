from powerinfer_jax import _cli
from powerinfer_jax.sparsify.cli import main

if __name__ == "__main__":
    _cli.run_main(main)
