package daemon

import (
	"errors"
	"fmt"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/mqtt"
	"github.com/tandem-edge/tandem/uplink"
)

// The checks of a config beyond its own file: the users, ACL, TLS, token
// and uplink password files it names are read at start, and a bad one
// stops the start before the data dir is touched (exit 2). `tandem check`
// runs the very same reads (CheckConfig), so it refuses what `tandem run`
// refuses, and says everything at once.

// inputs is what Start reads from the files the config names.
type inputs struct {
	access mqtt.Access
	tls    *mqtt.TLSConfig
}

// keyError is an error about the file a config key names.
type keyError struct {
	key string
	err error
}

func (e keyError) Error() string { return e.key + ": " + e.err.Error() }
func (e keyError) Unwrap() error { return e.err }

// loadInputs reads every file c names, reporting each one that fails as a
// ConfigError of its key (with the key's line in c's file).
func loadInputs(c *config.Config) (inputs, error) {
	var in inputs
	var errs []error
	keyed := func(err error) {
		var ke keyError
		for _, e := range unjoin(err) {
			if errors.As(e, &ke) {
				errs = append(errs, c.ErrorAt(ke.key, ke.err))
			} else {
				errs = append(errs, e)
			}
		}
	}
	var err error
	in.access, err = loadAccess(c.MQTT)
	keyed(err)
	if in.tls, err = mqttTLS(c.MQTT.TLS); err != nil {
		keyed(keyError{"mqtt.tls.cert_file", err})
	}
	if c.HTTP.TokenFile != "" {
		if _, err := admin.ReadToken(admin.TokenFile(c)); err != nil {
			keyed(keyError{"http.token_file", err})
		}
	}
	for i, uc := range c.Uplinks {
		// New reads the password and TLS files; the uplink only runs
		// once started, so these deps are never used.
		if _, err := uplink.New(uc.Uplink(c.Storage), uplink.Deps{Log: uplinkLog{}, Positions: positionSink{},
			Filters: config.UplinkFilters, Local: localPublisher{}}); err != nil {
			keyed(keyError{fmt.Sprintf("uplinks[%d]", i), err})
		}
	}
	return in, config.Join(errs...)
}

// unjoin returns the errors errors.Join put together (err itself when it
// is no join), without nils.
func unjoin(err error) []error {
	if err == nil {
		return nil
	}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	return []error{err}
}

// Check is the validation of both `tandem run` and `tandem check`: cfg's
// own rules, then the files it names, every error at once (a
// *config.ConfigError, or a config.ErrorList of them). loadErr is what
// config.LoadAll said of the file cfg came from; with none, cfg is
// validated here.
func Check(cfg *config.Config, loadErr error) error {
	err := loadErr
	if err == nil {
		err = cfg.Validate()
	}
	_, ferr := loadInputs(cfg)
	return config.Join(err, ferr)
}

// CheckConfig is `tandem check`: Check of the config file at path.
func CheckConfig(path string) error {
	cfg, err := config.LoadAll(path)
	if cfg == nil {
		return err
	}
	return Check(cfg, err)
}
