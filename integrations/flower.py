"""Flower (message API) plugin: LB-BSP for federated rounds.

Server: wrap any strategy in :class:`LoadBalanced`; each sampled client gets its own workload per round,
replies are weighted by the client's data size (or the samples processed) and FedNova-normalised when step
counts differ, and per-client history lives in Redis (:class:`lbbsp.client_history.ClientHistory`). Client:
run the loop inside a :class:`LocalRound`, which applies the workload, times download, compute and upload,
and builds the reply, with the client's hardware for the cold-start prior.
"""
from lbbsp.client_history import ClientHistory, ClientStatus

from .flower_client import ClientHardware, EmulatedLink, Link, LocalRound, MessageClock, Workload, hardware_reply
from .flower_server import ClientResult, LoadBalanced

__all__ = ["ClientHardware", "ClientHistory", "ClientResult", "ClientStatus", "EmulatedLink", "Link", "LoadBalanced",
           "LocalRound", "MessageClock", "Workload", "hardware_reply"]
