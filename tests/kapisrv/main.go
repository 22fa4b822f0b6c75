// kapisrv: a minimal Kubernetes-style API server built on the upstream k8s.io/apiserver
// library (generic registry + etcd3 storage + watch cache). It serves only
//
//	core/v1 services                     (/api/v1/.../services)
//	core/v1 nodes                        (/api/v1/nodes, cluster-scoped; no
//	                                      kubelet writes them: tests create them)
//	discovery.k8s.io/v1 endpointslices   (/apis/discovery.k8s.io/v1/.../endpointslices)
//
// with the real list/watch machinery: resourceVersions, bookmarks, 410 Gone ("too old
// resource version"), field/label selectors, paging, table output for kubectl.
// There is no validation, no defaulting, no ClusterIP allocation, no controllers, no
// namespaces resource, no auth (every request is anonymous and allowed). Short names:
// "svc" only (upstream has none for endpointslices either).
//
// Built by build.sh from Debian sid's golang-k8s-* packages (GOPATH mode); the OpenAPI
// definitions package kapisrv/generated/openapi is generated at build time by openapi-gen.
package main

import (
	"context"
	"flag"
	"net"
	"os"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/apiserver/pkg/authentication/request/anonymous"
	"k8s.io/apiserver/pkg/authorization/authorizerfactory"
	genericapifilters "k8s.io/apiserver/pkg/endpoints/filters"
	openapinamer "k8s.io/apiserver/pkg/endpoints/openapi"
	"k8s.io/apiserver/pkg/registry/generic"
	genericregistry "k8s.io/apiserver/pkg/registry/generic/registry"
	"k8s.io/apiserver/pkg/registry/rest"
	genericapiserver "k8s.io/apiserver/pkg/server"
	genericoptions "k8s.io/apiserver/pkg/server/options"
	"k8s.io/apiserver/pkg/storage/names"
	"k8s.io/apiserver/pkg/storage/storagebackend"
	"k8s.io/apiserver/pkg/util/compatibility"
	"k8s.io/apiserver/pkg/util/notfoundhandler"
	"k8s.io/klog/v2"

	"kapisrv/generated/openapi"
)

// etcdPrefix is the key prefix of all objects in etcd, e.g.
// /registry-kapisrv/services/<namespace>/<name> (JSON-encoded v1 objects).
const etcdPrefix = "/registry-kapisrv"

var (
	scheme = runtime.NewScheme()
	codecs = serializer.NewCodecFactory(scheme)
)

func init() {
	must(corev1.AddToScheme(scheme))
	must(discoveryv1.AddToScheme(scheme))
	// Use the external types as the "internal" version too: no conversion layer.
	scheme.AddKnownTypes(schema.GroupVersion{Group: "", Version: runtime.APIVersionInternal},
		&corev1.Service{}, &corev1.ServiceList{}, &corev1.Node{}, &corev1.NodeList{})
	scheme.AddKnownTypes(schema.GroupVersion{Group: discoveryv1.GroupName, Version: runtime.APIVersionInternal},
		&discoveryv1.EndpointSlice{}, &discoveryv1.EndpointSliceList{})
	metav1.AddToGroupVersion(scheme, schema.GroupVersion{Version: "v1"})
	scheme.AddUnversionedTypes(schema.GroupVersion{Group: "", Version: "v1"},
		&metav1.Status{}, &metav1.APIVersions{}, &metav1.APIGroupList{}, &metav1.APIGroup{}, &metav1.APIResourceList{})
	must(scheme.SetVersionPriority(corev1.SchemeGroupVersion))
	must(scheme.SetVersionPriority(discoveryv1.SchemeGroupVersion))
}

func must(err error) {
	if err != nil {
		klog.Fatal(err)
	}
}

// strategy accepts every object as-is: no validation, no defaulting, no status split.
type strategy struct {
	runtime.ObjectTyper
	names.NameGenerator
}

func (strategy) NamespaceScoped() bool                                             { return true }

// clusterStrategy is strategy for cluster-scoped resources (nodes).
type clusterStrategy struct{ strategy }

func (clusterStrategy) NamespaceScoped() bool { return false }
func (strategy) PrepareForCreate(ctx context.Context, obj runtime.Object)          {}
func (strategy) PrepareForUpdate(ctx context.Context, obj, old runtime.Object)     {}
func (strategy) Validate(ctx context.Context, obj runtime.Object) field.ErrorList  { return nil }
func (strategy) WarningsOnCreate(ctx context.Context, obj runtime.Object) []string { return nil }
func (strategy) AllowCreateOnUpdate() bool                                         { return false }
func (strategy) AllowUnconditionalUpdate() bool                                    { return true }
func (strategy) Canonicalize(obj runtime.Object)                                   {}
func (strategy) ValidateUpdate(ctx context.Context, obj, old runtime.Object) field.ErrorList {
	return nil
}
func (strategy) WarningsOnUpdate(ctx context.Context, obj, old runtime.Object) []string { return nil }

// shortNamed adds kubectl short names (e.g. "svc") to a store's discovery entry.
type shortNamed struct {
	*genericregistry.Store
	short []string
}

func (s shortNamed) ShortNames() []string { return s.short }

func newStore(gr, singular schema.GroupResource, newf, newl func() runtime.Object, opts generic.RESTOptionsGetter) *genericregistry.Store {
	return newStoreWith(strategy{scheme, names.SimpleNameGenerator}, gr, singular, newf, newl, opts)
}

type anyStrategy interface {
	rest.RESTCreateStrategy
	rest.RESTUpdateStrategy
	rest.RESTDeleteStrategy
}

func newStoreWith(s anyStrategy, gr, singular schema.GroupResource, newf, newl func() runtime.Object, opts generic.RESTOptionsGetter) *genericregistry.Store {
	st := &genericregistry.Store{
		NewFunc:                   newf,
		NewListFunc:               newl,
		DefaultQualifiedResource:  gr,
		SingularQualifiedResource: singular,
		CreateStrategy:            s,
		UpdateStrategy:            s,
		DeleteStrategy:            s,
		TableConvertor:            rest.NewDefaultTableConvertor(gr),
	}
	must(st.CompleteWithOptions(&generic.StoreOptions{RESTOptions: opts}))
	return st
}

func main() {
	klog.InitFlags(nil)
	etcd := flag.String("etcd", "http://127.0.0.1:2379", "etcd client URL")
	bind := flag.String("bind-address", "127.0.0.1", "address to serve HTTPS on")
	port := flag.Int("port", 6443, "HTTPS port")
	certDir := flag.String("cert-dir", "/tmp/kapisrv-certs",
		"directory with apiserver.crt/apiserver.key (a self-signed pair is generated there if missing)")
	watchCache := flag.Bool("watch-cache", true, "enable the apiserver watch cache")
	flag.Parse()

	cfg := genericapiserver.NewRecommendedConfig(codecs)
	cfg.EffectiveVersion = compatibility.DefaultBuildEffectiveVersion()

	bindIP := net.ParseIP(*bind)
	if bindIP == nil {
		klog.Fatalf("--bind-address %q is not an IP address", *bind)
	}
	ss := genericoptions.NewSecureServingOptions().WithLoopback()
	ss.BindAddress = bindIP
	ss.BindPort = *port
	ss.ServerCert.CertDirectory = *certDir
	must(ss.MaybeDefaultWithSelfSignedCerts("localhost", nil, []net.IP{net.ParseIP("127.0.0.1"), bindIP}))
	must(ss.ApplyTo(&cfg.SecureServing, &cfg.LoopbackClientConfig))

	codec := codecs.LegacyCodec(corev1.SchemeGroupVersion, discoveryv1.SchemeGroupVersion)
	eo := genericoptions.NewEtcdOptions(storagebackend.NewDefaultConfig(etcdPrefix, codec))
	eo.StorageConfig.Transport.ServerList = []string{*etcd}
	eo.EnableWatchCache = *watchCache
	must(eo.ApplyTo(&cfg.Config))

	cfg.Authentication.Authenticator = anonymous.NewAuthenticator(nil)
	cfg.Authorization.Authorizer = authorizerfactory.NewAlwaysAllowAuthorizer()
	namer := openapinamer.NewDefinitionNamer(scheme)
	cfg.OpenAPIConfig = genericapiserver.DefaultOpenAPIConfig(openapi.GetOpenAPIDefinitions, namer)
	cfg.OpenAPIConfig.Info.Title, cfg.OpenAPIConfig.Info.Version = "kapisrv", "v1"
	cfg.OpenAPIV3Config = genericapiserver.DefaultOpenAPIV3Config(openapi.GetOpenAPIDefinitions, namer)
	cfg.OpenAPIV3Config.Info.Title, cfg.OpenAPIV3Config.Info.Version = "kapisrv", "v1"

	// As kube-apiserver: a path nothing serves (an API group kapisrv does not
	// have, such as networking.k8s.io) is answered 404 with a NotFound Status,
	// not with the generic server's index of paths (a JSON body that is no Status).
	notFound := notfoundhandler.New(codecs, genericapifilters.NoMuxAndDiscoveryIncompleteKey)
	srv, err := cfg.Complete().New("kapisrv", genericapiserver.NewEmptyDelegateWithCustomHandler(notFound))
	must(err)

	core := genericapiserver.NewDefaultAPIGroupInfo("", scheme, metav1.ParameterCodec, codecs)
	core.VersionedResourcesStorageMap["v1"] = map[string]rest.Storage{
		"services": shortNamed{newStore(corev1.Resource("services"), corev1.Resource("service"),
			func() runtime.Object { return &corev1.Service{} },
			func() runtime.Object { return &corev1.ServiceList{} }, cfg.RESTOptionsGetter), []string{"svc"}},
		"nodes": shortNamed{newStoreWith(clusterStrategy{strategy{scheme, names.SimpleNameGenerator}},
			corev1.Resource("nodes"), corev1.Resource("node"),
			func() runtime.Object { return &corev1.Node{} },
			func() runtime.Object { return &corev1.NodeList{} }, cfg.RESTOptionsGetter), []string{"no"}},
	}
	must(srv.InstallLegacyAPIGroup("/api", &core))

	disc := genericapiserver.NewDefaultAPIGroupInfo(discoveryv1.GroupName, scheme, metav1.ParameterCodec, codecs)
	disc.VersionedResourcesStorageMap["v1"] = map[string]rest.Storage{
		"endpointslices": newStore(discoveryv1.Resource("endpointslices"), discoveryv1.Resource("endpointslice"),
			func() runtime.Object { return &discoveryv1.EndpointSlice{} },
			func() runtime.Object { return &discoveryv1.EndpointSliceList{} }, cfg.RESTOptionsGetter),
	}
	must(srv.InstallAPIGroup(&disc))

	ctx := genericapiserver.SetupSignalContext()
	if err := srv.PrepareRun().RunWithContext(ctx); err != nil {
		klog.Error(err)
		os.Exit(1)
	}
}
