"""The tenant policies an engine keeps resident: loading, the watch, eviction.

The engine watches the policy KV and loads a new version's weights before it
becomes the "latest" it serves; a request pinned to an older retained version is
served by that version (loaded on demand). Per tenant policy the latest version
plus the most recently used others, at most ``retain_versions`` in all, stay
resident. See docs/ARCHITECTURE.md ("The Inference Queue").
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.features import FeatureSchema
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.agents.models.policyio import PolicyStore, feature_schema_of
from joynexus.schemas.inference import IncompatibleSchema, PolicyRecord

log = logging.getLogger(__name__)

PolicyId = tuple[str, str, int]  # (tenant, workload, version)


@dataclass(frozen=True)
class LoadedPolicy:
    """One tenant policy version, resident and ready to decode."""

    record: PolicyRecord
    schema: FeatureSchema
    module: TenantModule

    @property
    def id(self) -> PolicyId:
        return (self.record.tenant_id, self.record.workload, self.record.version)


def evictions(
    resident: Iterable[PolicyId], latest: int | None, used: Mapping[PolicyId, int], retain: int
) -> list[PolicyId]:
    """Which of one tenant policy's resident versions to drop: the latest stays, and of
    the others the most recently used, ``retain`` in all (a request in flight holds its
    own reference, so eviction never affects it)."""
    resident = list(resident)
    others = [pid for pid in resident if pid[2] != latest]
    keep = retain - (1 if latest is not None and any(pid[2] == latest for pid in resident) else 0)
    others.sort(key=lambda pid: used.get(pid, -1), reverse=True)
    return others[max(0, keep) :]


#: Announced versions of policies not held, remembered at most (the oldest forgotten).
MAX_ANNOUNCED = 65_536


class PolicyCache:
    """The resident versions of the tenant policies for one base model."""

    def __init__(
        self,
        store: PolicyStore,
        backbone: Backbone,
        *,
        base_model: str,
        retain_versions: int,
        instance: str,
    ) -> None:
        self.store = store
        self.backbone = backbone
        self.base_model = base_model
        self.retain_versions = retain_versions
        self.instance = instance
        self._policies: dict[PolicyId, LoadedPolicy] = {}
        #: The resident versions of each policy (``_policies`` by tenant and workload):
        #: what a policy holds is read per published version, not by scanning every one.
        self._versions: dict[tuple[str, str], set[int]] = {}
        self._used: dict[PolicyId, int] = {}  # last use, for eviction
        self._uses = itertools.count()
        self._latest: dict[tuple[str, str], int] = {}
        #: Versions the watch announced for policies this engine does not hold (not loaded
        #: until asked for): a request for the latest then loads the announced one.
        self._announced: dict[tuple[str, str], int] = {}
        self._loading: dict[PolicyId, asyncio.Future[LoadedPolicy]] = {}
        #: Loads in flight per policy (``_loading`` by tenant and workload).
        self._loads: Counter[tuple[str, str]] = Counter()

    def loaded_versions(self, tenant_id: str, workload: str = "default") -> list[int]:
        return sorted(self._versions.get((tenant_id, workload), ()))

    def latest_version(self, tenant_id: str, workload: str = "default") -> int | None:
        return self._latest.get((tenant_id, workload))

    def _announce(self, tk: tuple[str, str], version: int) -> None:
        """Note a version of a policy not held here. Bounded: tenants can create and
        cancel workloads without end, and an entry only matters while a load on demand
        may race the version's publish, so past ``MAX_ANNOUNCED`` the oldest go."""
        self._announced[tk] = max(self._announced.pop(tk, 0), version)  # the newest last
        while len(self._announced) > MAX_ANNOUNCED:
            del self._announced[next(iter(self._announced))]

    def _held(self, tk: tuple[str, str]) -> bool:
        """A version of the policy is resident or loading here."""
        return tk in self._versions or tk in self._loads

    async def watch(self, ready: asyncio.Event) -> None:
        """Load the versions the policy KV announces for this base model: every current
        one before ``ready`` is set (a current one that fails raises), then each new
        version of a policy this engine holds (its next request finds it resident). A
        policy it does not hold is loaded when first asked for (``resolve``): an eager
        load of every tenant's new workload cost the other tenants' requests the load's
        CPU, for a policy no one may call here (issue 24)."""
        async for rec in self.store.watch(ready=ready):
            if rec.base_model != self.base_model:
                continue
            tk = (rec.tenant_id, rec.workload)
            if ready.is_set() and not self._held(tk):
                self._announce(tk, rec.version)
                continue
            try:
                await self.ensure_loaded(rec)
            except Exception as e:
                if not ready.is_set():
                    raise  # a current version that does not load fails prepare()
                log.warning(
                    "engine %s: version %d of %s.%s does not load, keeps serving v%s: %s",
                    self.instance,
                    rec.version,
                    rec.tenant_id,
                    rec.workload,
                    self._latest.get((rec.tenant_id, rec.workload)),
                    e,
                )
                continue
            self.advance_latest(rec)

    def advance_latest(self, rec: PolicyRecord) -> None:
        tk = (rec.tenant_id, rec.workload)
        if rec.version > self._latest.get(tk, 0):
            self._latest[tk] = rec.version
            self._evict(tk)
        if self._announced.get(tk, 0) <= rec.version:
            self._announced.pop(tk, None)

    def _evict(self, tk: tuple[str, str]) -> None:
        held = self._versions.get(tk)
        if not held:
            return
        resident = [(tk[0], tk[1], v) for v in held]
        for pid in evictions(resident, self._latest.get(tk), self._used, self.retain_versions):
            self._policies.pop(pid, None)
            self._used.pop(pid, None)
            held.discard(pid[2])
        if not held:
            del self._versions[tk]

    async def ensure_loaded(self, rec: PolicyRecord) -> LoadedPolicy:
        pid = (rec.tenant_id, rec.workload, rec.version)
        lp = self._policies.get(pid)
        if lp is not None:
            return lp
        fut = self._loading.get(pid)
        if fut is None:
            fut = asyncio.ensure_future(self._load(rec))
            self._loading[pid] = fut
            self._loads[pid[:2]] += 1
            fut.add_done_callback(lambda _f: self._loaded(pid))
        return await asyncio.shield(fut)

    def _loaded(self, pid: PolicyId) -> None:
        """A load ended (loaded or failed)."""
        self._loading.pop(pid, None)
        tk = (pid[0], pid[1])
        self._loads[tk] -= 1
        if self._loads[tk] <= 0:
            del self._loads[tk]

    async def _load(self, rec: PolicyRecord) -> LoadedPolicy:
        if rec.base_model != self.base_model:
            raise IncompatibleSchema(
                f"tenant {rec.tenant_id!r} policy {rec.workload!r} v{rec.version} is for base model "
                f"{rec.base_model!r}; this endpoint serves {self.base_model!r}"
            )
        schema = feature_schema_of(rec)
        fd = rec.head_config.get("feature_dim")
        if fd != self.backbone.feature_dim:
            raise IncompatibleSchema(
                f"tenant {rec.tenant_id!r} v{rec.version}: head expects features of dim {fd} but "
                f"{self.base_model} gives {self.backbone.feature_dim}; retrain the head on this backbone"
            )
        module = await self.store.load_module(rec)
        lp = LoadedPolicy(rec, schema, module)
        self._policies[lp.id] = lp
        self._versions.setdefault((rec.tenant_id, rec.workload), set()).add(rec.version)
        self._used[lp.id] = next(self._uses)
        self._evict((rec.tenant_id, rec.workload))
        log.info(
            "engine %s loaded %s.%s v%d", self.instance, rec.tenant_id, rec.workload, rec.version
        )
        return lp

    def lookup(self, tenant_id: str, workload: str, version: int | None) -> LoadedPolicy | None:
        """The resident policy a request asks for (None: not resident)."""
        v = version or self._latest.get((tenant_id, workload))
        if v is None:
            return None
        if not version and self._announced.get((tenant_id, workload), 0) > v:
            return None  # a newer version was announced: resolve loads it
        lp = self._policies.get((tenant_id, workload, v))
        if lp is not None:
            self._used[lp.id] = next(self._uses)
        return lp

    async def resolve(self, tenant_id: str, workload: str, version: int | None) -> LoadedPolicy:
        """The policy a request asks for, loading it from the store when not resident."""
        lp = self.lookup(tenant_id, workload, version)
        if lp is not None:
            return lp
        rec = await self.store.get(
            tenant_id, workload, version
        )  # UnknownTenant / UnknownPolicyVersion
        lp = await self.ensure_loaded(rec)
        if not version:
            self.advance_latest(rec)
        return lp
