"""A logging helper asks for the rank before the process group exists."""

import logging

import torch.distributed as dist


def get_logger():
    logger = logging.getLogger("train")
    logging.basicConfig(format=f"[rank {dist.get_rank()}] %(message)s", level=logging.INFO)
    return logger


def main():
    log = get_logger()
    dist.init_process_group(backend="gloo")
    log.info("process group ready")
    dist.barrier()


if __name__ == "__main__":
    main()
